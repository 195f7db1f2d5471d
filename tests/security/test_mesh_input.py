"""Bad input on a mesh: every rank validates the same input before the first collective and raises the same
error, so no rank returns while another waits in a collective (which would desynchronise the next one)."""

from __future__ import annotations

import pytest
import torch

from ringmoe.model import MoETransformer, preset
from ringmoe.serve import generate
from ringmoe.parallel import make_mesh
from ringmoe.parallel.launch import spawn

CONFIG = preset("tiny")


def _generate_then_check_the_group(rank, world, bad_prompt):
    model = MoETransformer(CONFIG, make_mesh(world, 1)).double()
    model.init_weights(0)
    try:
        generate(model, bad_prompt, 2)
    except ValueError as error:
        message = str(error)
    else:
        message = None
    good = torch.randint(0, CONFIG.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    tokens = generate(model, good, 3).tokens  # the group still works: the ranks stayed in step
    return message, tokens


@pytest.mark.parametrize("bad", [[[3, 1, CONFIG.vocab_size + 4]], [[-1, 2]]], ids=["past-vocab", "negative"])
def test_every_rank_raises_the_same_error_and_the_group_still_works(bad):
    results = spawn(_generate_then_check_the_group, 2, torch.tensor(bad), timeout=120)
    messages = [m for m, _ in results]
    assert messages[0] is not None and messages[0] == messages[1] and "prompt token ids" in messages[0]
    assert torch.equal(results[0][1], results[1][1])

