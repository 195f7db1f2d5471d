/* ringmoe's C kernels as torch operators that run without Python: the CPU kernels of
 * ``ringmoe::paged_cached_attention`` and ``ringmoe::grouped_experts`` registered on torch's dispatcher through
 * libtorch's stable C shim, and ``ringmoe::panel_linear``, a product by a weight's panel copy.
 *
 * An operator whose kernel is a Python function costs, called from a compiled graph, the dispatcher's way into
 * Python and the function's own checks: ~25-50 us a call on 2 CPU threads, per layer per decode step.  libtorch
 * exports with C linkage the functions that register a boxed kernel (``aoti_torch_library_impl``: a function of a
 * stack of 64-bit values) and read or make tensors (``aoti_torch_get_data_ptr``, ``aoti_torch_empty_strided``...),
 * so plain C (this file, built with the other kernels by gcc) can register one.  The functions are not linked:
 * the Python side (``panel_gemm.register_torch_ops``) looks them up in the loaded libtorch and hands their
 * addresses over once (a machine whose torch lacks one keeps the Python kernels).
 *
 * The boxed calling convention (libtorch's ``StableIValueBoxedKernel``): the stack holds the schema's arguments in
 * order, each tensor as a new handle that the kernel owns (it deletes it), a float as the bits of a double; the
 * kernel leaves its returns at the start of the stack, each tensor as a handle torch takes over.  A failure
 * raises through ``aoti_torch_check`` (a c10::Error thrown from libtorch, a RuntimeError in Python): this file is
 * compiled with unwind tables (-fexceptions), so the exception passes through its frames, which hold nothing to
 * release by then.
 *
 * ``grouped_experts`` names its MoE layer by an int key (``moe/grouped_op.py``): ``ringmoe::bind_experts`` gives this
 * file the layer's panel copies, biases and activation (it keeps the tensors' handles: references, released when
 * the key is bound again or unbound with empty tensors); a key with nothing bound runs the operator's Python kernel
 * (``ringmoe::grouped_experts_python``, called through the dispatcher).
 */
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef uint64_t StableIValue;
typedef struct AtenTensorOpaque *AtenTensorHandle;
typedef struct TorchLibraryOpaque *TorchLibraryHandle;
typedef int32_t TorchError; /* 0: success */

/* the libtorch functions used here, in the order ``panel_gemm.register_torch_ops`` fills them */
struct torch_api {
    TorchError (*library_init_impl)(const char *ns, const char *key, const char *file, uint32_t line,
                                    TorchLibraryHandle *out);
    TorchError (*library_impl)(TorchLibraryHandle lib, const char *name,
                               void (*fn)(StableIValue *, uint64_t, uint64_t));
    TorchError (*data_ptr)(AtenTensorHandle t, void **out);
    TorchError (*dim)(AtenTensorHandle t, int64_t *out);
    TorchError (*sizes)(AtenTensorHandle t, int64_t **out);
    TorchError (*dtype)(AtenTensorHandle t, int32_t *out);
    TorchError (*device_type)(AtenTensorHandle t, int32_t *out);
    TorchError (*is_contiguous)(AtenTensorHandle t, bool *out);
    TorchError (*empty_strided)(int64_t ndim, const int64_t *sizes, const int64_t *strides, int32_t dtype,
                                int32_t device_type, int32_t device_index, AtenTensorHandle *out);
    TorchError (*delete_tensor)(AtenTensorHandle t);
    void (*check)(bool cond, const char *func, const char *file, uint32_t line, const char *msg);
    TorchError (*num_threads)(uint32_t *out);
    TorchError (*numel)(AtenTensorHandle t, int64_t *out);
    TorchError (*call_dispatcher)(const char *op, const char *overload, StableIValue *stack);
    int32_t float32, int64, cpu; /* torch's codes of the two dtypes and the CPU device */
};

static struct torch_api api;

int paged_cached_attention(const float *q, int64_t n, int64_t heads, int64_t D, const float *k_cache,
                           const float *v_cache, int64_t blocks, int64_t bs, int64_t kv_heads, const int64_t *tables,
                           int64_t width, const int64_t *first, const int64_t *last, float scale, float *out,
                           float *lse, int threads);

int panel_grouped(const float *x, const int64_t *offsets, int64_t G, const float *packed, int64_t N, int64_t K,
                  float *y, int threads);

int panel_moe(const float *x, int64_t T, int64_t H, const int64_t *topk_idx, const float *topk_weight, int64_t k,
              int64_t E, const float *gate_up, const float *gate_up_bias, const float *down, const float *down_bias,
              int64_t F, float limit, float alpha, float *y, int64_t *counts, int threads);

/* Is t a contiguous CPU tensor of this dtype and number of dimensions. */
static bool fits(AtenTensorHandle t, int32_t dtype, int64_t dims) {
    int32_t code, device;
    int64_t count;
    bool contiguous;
    if (api.dtype(t, &code) || api.device_type(t, &device) || api.dim(t, &count) || api.is_contiguous(t, &contiguous))
        return false;
    return code == dtype && device == api.cpu && count == dims && contiguous;
}

static int64_t *shape(AtenTensorHandle t) {
    int64_t *sizes = NULL;
    api.sizes(t, &sizes);
    return sizes;
}

static void *data(AtenTensorHandle t) {
    void *pointer = NULL;
    api.data_ptr(t, &pointer);
    return pointer;
}

/* torch's thread count now (``torch.set_num_threads``): the kernels' OpenMP threads. */
static int threads_now(void) {
    uint32_t threads = 1;
    if (api.num_threads(&threads) || threads < 1)
        threads = 1;
    return (int)threads;
}

/* A contiguous float32 CPU tensor of ``dims`` sizes, or NULL. */
static AtenTensorHandle empty(int64_t dims, const int64_t *sizes) {
    int64_t strides[4];
    strides[dims - 1] = 1;
    for (int64_t d = dims - 1; d > 0; d--)
        strides[d - 1] = strides[d] * sizes[d];
    AtenTensorHandle t = NULL;
    return api.empty_strided(dims, sizes, strides, api.float32, api.cpu, 0, &t) ? NULL : t;
}

/* Release the handles, then raise ``message`` (a RuntimeError in Python; ``check`` never returns when false). */
__attribute__((noreturn)) static void fail(AtenTensorHandle *handles, int count, const char *message) {
    for (int i = 0; i < count; i++)
        if (handles[i] != NULL)
            api.delete_tensor(handles[i]);
    api.check(false, "ringmoe", __FILE__, __LINE__, message);
    abort();
}

/* paged_cached_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor first, Tensor last,
 * float scale) -> (Tensor out, Tensor lse): ``paged_cpu._paged_cached_attention``'s contract. */
static void attention_kernel(StableIValue *stack, uint64_t num_args, uint64_t num_outputs) {
    (void)num_args, (void)num_outputs;
    AtenTensorHandle h[8]; /* q, k_cache, v_cache, tables, first, last; out, lse */
    for (int i = 0; i < 6; i++)
        h[i] = (AtenTensorHandle)(uintptr_t)stack[i];
    h[6] = h[7] = NULL;
    double scale;
    memcpy(&scale, &stack[6], sizeof scale);
    if (!fits(h[0], api.float32, 3) || !fits(h[1], api.float32, 4) || !fits(h[2], api.float32, 4)
        || !fits(h[3], api.int64, 2) || !fits(h[4], api.int64, 1) || !fits(h[5], api.int64, 1))
        fail(h, 8, "paged_cached_attention: q, k_cache, v_cache must be contiguous float32 CPU tensors (n, heads, "
                   "D), (blocks, block_size, kv_heads, D); tables, first, last contiguous int64 (n, width), (n,)");
    const int64_t *q = shape(h[0]), *k = shape(h[1]), *v = shape(h[2]), *tables = shape(h[3]);
    int64_t n = q[0], heads = q[1], dim = q[2];
    if (memcmp(k, v, 4 * sizeof(int64_t)) || k[3] != dim || k[2] < 1 || heads % k[2] || tables[0] != n
        || shape(h[4])[0] != n || shape(h[5])[0] != n)
        fail(h, 8, "paged_cached_attention: q, the caches, tables, first and last do not fit together");
    int64_t out_sizes[3] = {n, heads, dim};
    h[6] = empty(3, out_sizes);
    h[7] = empty(2, out_sizes);
    if (h[6] == NULL || h[7] == NULL)
        fail(h, 8, "paged_cached_attention: out of memory for the output");
    int status = paged_cached_attention(data(h[0]), n, heads, dim, data(h[1]), data(h[2]), k[0], k[1], k[2],
                                        data(h[3]), tables[1], data(h[4]), data(h[5]), (float)scale, data(h[6]),
                                        data(h[7]), threads_now());
    if (status == -2)
        fail(h, 8, "paged_cached_attention: a block table entry or a row's key range lies outside the cache or the "
                   "table");
    if (status != 0)
        fail(h, 8, "paged_cached_attention: out of memory for the scratch of a thread");
    for (int i = 0; i < 6; i++)
        api.delete_tensor(h[i]);
    stack[0] = (StableIValue)(uintptr_t)h[6];
    stack[1] = (StableIValue)(uintptr_t)h[7];
}

/* panel_linear(Tensor x, Tensor panels) -> Tensor: x (T, K) float32 times the weight W (N, K) whose panel copy
 * (``panel_gemm.pack``) ``panels`` holds in a tensor of W's shape: (T, N) = x @ W.T (``prepacked.panel_linear``). */
static void linear_kernel(StableIValue *stack, uint64_t num_args, uint64_t num_outputs) {
    (void)num_args, (void)num_outputs;
    AtenTensorHandle h[3] = {(AtenTensorHandle)(uintptr_t)stack[0], (AtenTensorHandle)(uintptr_t)stack[1], NULL};
    if (!fits(h[0], api.float32, 2) || !fits(h[1], api.float32, 2) || shape(h[0])[1] != shape(h[1])[1])
        fail(h, 3, "panel_linear: x (T, K) and panels (N, K) must be contiguous float32 CPU matrices of one K");
    const int64_t *x = shape(h[0]), *w = shape(h[1]);
    int64_t out_sizes[2] = {x[0], w[0]}, offsets[2] = {0, x[0]};
    h[2] = empty(2, out_sizes);
    if (h[2] == NULL || (x[0] > 0 && panel_grouped(data(h[0]), offsets, 1, data(h[1]), w[0], w[1], data(h[2]),
                                                   threads_now()) != 0))
        fail(h, 3, "panel_linear: out of memory");
    api.delete_tensor(h[0]);
    api.delete_tensor(h[1]);
    stack[0] = (StableIValue)(uintptr_t)h[2];
}

/* A MoE layer's experts as ``bind_experts`` gave them: panel copies gate_up (E, 2F * H), down (E, H * F) float32,
 * biases (E, 2F), (E, H) or NULL; the tensors' handles are this table's references. */
struct experts {
    int64_t key, experts, hidden, ffn;
    AtenTensorHandle tensors[4]; /* gate_up, down, gate_up_bias, down_bias (NULL: none) */
    float limit, alpha;
};

static struct experts *bound;
static size_t bound_count, bound_room;
static char python_kernel[128]; /* "<ns>::grouped_experts_python" */
static pthread_mutex_t bound_lock = PTHREAD_MUTEX_INITIALIZER;

static void release(struct experts *entry) {
    for (int i = 0; i < 4; i++)
        if (entry->tensors[i] != NULL)
            api.delete_tensor(entry->tensors[i]);
}

static int64_t numel(AtenTensorHandle t) {
    int64_t count = 0;
    api.numel(t, &count);
    return count;
}

/* bind_experts(int layer, Tensor gate_up, Tensor down, Tensor gate_up_bias, Tensor down_bias, int ffn_size,
 * float limit, float alpha) -> (): the layer's panel copies (``panel_gemm.pack``) and biases (empty: none); empty
 * panels unbind the layer.  limit < 0: no clamp (``panel_moe``'s convention). */
static void bind_kernel(StableIValue *stack, uint64_t num_args, uint64_t num_outputs) {
    (void)num_args, (void)num_outputs;
    struct experts entry = {.key = (int64_t)stack[0], .ffn = (int64_t)stack[5]};
    double limit, alpha;
    memcpy(&limit, &stack[6], sizeof limit);
    memcpy(&alpha, &stack[7], sizeof alpha);
    entry.limit = (float)limit, entry.alpha = (float)alpha;
    for (int i = 0; i < 4; i++)
        entry.tensors[i] = (AtenTensorHandle)(uintptr_t)stack[1 + i];
    bool unbind = numel(entry.tensors[0]) == 0;
    if (!unbind) {
        if (!fits(entry.tensors[0], api.float32, 2) || !fits(entry.tensors[1], api.float32, 2))
            fail(entry.tensors, 4, "bind_experts: the panel copies must be contiguous float32 CPU matrices");
        const int64_t *gate_up = shape(entry.tensors[0]), *down = shape(entry.tensors[1]);
        entry.experts = gate_up[0];
        entry.hidden = entry.ffn > 0 ? down[1] / entry.ffn : 0;
        bool biases_fit = true;
        for (int i = 2; i < 4; i++) {
            if (numel(entry.tensors[i]) == 0) {
                api.delete_tensor(entry.tensors[i]);
                entry.tensors[i] = NULL;
            } else {
                const int64_t *b = shape(entry.tensors[i]);
                biases_fit &= fits(entry.tensors[i], api.float32, 2) && b[0] == entry.experts
                              && b[1] == (i == 2 ? 2 * entry.ffn : entry.hidden);
            }
        }
        if (entry.hidden < 1 || down[0] != entry.experts || down[1] != entry.hidden * entry.ffn
            || gate_up[1] != 2 * entry.ffn * entry.hidden || !biases_fit)
            fail(entry.tensors, 4, "bind_experts: the panel copies and biases do not fit together");
    }
    pthread_mutex_lock(&bound_lock);
    size_t i = 0;
    while (i < bound_count && bound[i].key != entry.key)
        i++;
    if (i < bound_count) { /* the key's earlier binding is released (unbinding: the last entry takes its place) */
        release(&bound[i]);
        bound[i] = bound[--bound_count];
    }
    if (unbind) {
        pthread_mutex_unlock(&bound_lock);
        release(&entry);
        return;
    }
    if (bound_count == bound_room) {
        size_t room = bound_room ? 2 * bound_room : 16;
        struct experts *grown = realloc(bound, room * sizeof *grown);
        if (grown == NULL) {
            pthread_mutex_unlock(&bound_lock);
            fail(entry.tensors, 4, "bind_experts: out of memory");
        }
        bound = grown;
        bound_room = room;
    }
    bound[bound_count++] = entry;
    pthread_mutex_unlock(&bound_lock);
}

/* grouped_experts(Tensor x, Tensor topk_idx, Tensor topk_weight, int layer) -> Tensor: the layer's dropless routed
 * output (T, H) float32 (``panel_moe``); a layer with nothing bound: the Python kernel. */
static void experts_kernel(StableIValue *stack, uint64_t num_args, uint64_t num_outputs) {
    (void)num_args, (void)num_outputs;
    AtenTensorHandle h[4] = {(AtenTensorHandle)(uintptr_t)stack[0], (AtenTensorHandle)(uintptr_t)stack[1],
                             (AtenTensorHandle)(uintptr_t)stack[2], NULL}; /* x, topk_idx, topk_weight; y */
    int64_t key = (int64_t)stack[3];
    pthread_mutex_lock(&bound_lock);
    struct experts *entry = NULL;
    for (size_t i = 0; i < bound_count && entry == NULL; i++)
        if (bound[i].key == key)
            entry = &bound[i];
    if (entry == NULL) {
        pthread_mutex_unlock(&bound_lock);
        if (api.call_dispatcher(python_kernel, "", stack)) { /* the stack's handles go with the call */
            char message[320]; /* the Python error stays behind the C shim: say where to see it */
            snprintf(message, sizeof message, "grouped_experts: layer %lld has no C binding and the operator's "
                     "Python kernel failed: call %s with the same arguments to see its error", (long long)key,
                     python_kernel);
            api.check(false, "ringmoe", __FILE__, __LINE__, message);
        }
        return; /* stack[0]: its output */
    }
    const int64_t *x = shape(h[0]), *idx = shape(h[1]), *weight = shape(h[2]);
    if (!fits(h[0], api.float32, 2) || !fits(h[1], api.int64, 2) || !fits(h[2], api.float32, 2)
        || x[1] != entry->hidden || idx[0] != x[0] || weight[0] != x[0] || idx[1] != weight[1]) {
        pthread_mutex_unlock(&bound_lock);
        fail(h, 4, "grouped_experts: x (T, H) float32, topk_idx (T, k) int64 and topk_weight (T, k) float32, "
                   "contiguous, do not fit the layer's experts");
    }
    int64_t out_sizes[2] = {x[0], x[1]};
    h[3] = empty(2, out_sizes);
    int64_t *counts = malloc(sizeof(int64_t) * (size_t)entry->experts);
    int status = -1;
    if (h[3] != NULL && counts != NULL)
        status = panel_moe(data(h[0]), x[0], x[1], data(h[1]), data(h[2]), idx[1], entry->experts,
                           data(entry->tensors[0]), entry->tensors[2] ? data(entry->tensors[2]) : NULL,
                           data(entry->tensors[1]), entry->tensors[3] ? data(entry->tensors[3]) : NULL, entry->ffn,
                           entry->limit, entry->alpha, data(h[3]), counts, threads_now());
    pthread_mutex_unlock(&bound_lock);
    free(counts);
    if (status == -2)
        fail(h, 4, "grouped_experts: topk_idx holds an expert index outside the layer's experts");
    if (status != 0)
        fail(h, 4, "grouped_experts: out of memory for a MoE layer's buffers");
    for (int i = 0; i < 3; i++)
        api.delete_tensor(h[i]);
    stack[0] = (StableIValue)(uintptr_t)h[3];
}

/* Register the kernels above for the CPU under namespace ``ns`` (whose operators Python has defined); 0 on success.
 * The library object stays for the process's life: the registration lasts as long. */
int ringmoe_register_torch_ops(const struct torch_api *functions, const char *ns) {
    api = *functions;
    TorchLibraryHandle lib = NULL;
    if (api.library_init_impl(ns, "CPU", __FILE__, __LINE__, &lib) || lib == NULL)
        return -1;
    if (strlen(ns) + sizeof "::grouped_experts_python" > sizeof python_kernel)
        return -1;
    strcpy(python_kernel, ns);
    strcat(python_kernel, "::grouped_experts_python");
    if (api.library_impl(lib, "paged_cached_attention", attention_kernel)
        || api.library_impl(lib, "panel_linear", linear_kernel)
        || api.library_impl(lib, "bind_experts", bind_kernel)
        || api.library_impl(lib, "grouped_experts", experts_kernel))
        return -1;
    return 0;
}
