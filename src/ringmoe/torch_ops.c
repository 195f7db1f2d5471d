/* ringmoe's C kernels as torch operators that run without Python: the CPU kernel of
 * ``ringmoe::paged_cached_attention`` registered on torch's dispatcher through libtorch's stable C shim.
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
 */
#include <stdbool.h>
#include <stdint.h>
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
    int32_t float32, int64, cpu; /* torch's codes of the two dtypes and the CPU device */
};

static struct torch_api api;

int paged_cached_attention(const float *q, int64_t n, int64_t heads, int64_t D, const float *k_cache,
                           const float *v_cache, int64_t blocks, int64_t bs, int64_t kv_heads, const int64_t *tables,
                           int64_t width, const int64_t *first, const int64_t *last, float scale, float *out,
                           float *lse, int threads);

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
    uint32_t threads = 1;
    if (api.num_threads(&threads) || threads < 1)
        threads = 1;
    int status = paged_cached_attention(data(h[0]), n, heads, dim, data(h[1]), data(h[2]), k[0], k[1], k[2],
                                        data(h[3]), tables[1], data(h[4]), data(h[5]), (float)scale, data(h[6]),
                                        data(h[7]), (int)threads);
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

/* Register the kernels above for the CPU under namespace ``ns`` (whose operators Python has defined); 0 on success.
 * The library object stays for the process's life: the registration lasts as long. */
int ringmoe_register_torch_ops(const struct torch_api *functions, const char *ns) {
    api = *functions;
    TorchLibraryHandle lib = NULL;
    if (api.library_init_impl(ns, "CPU", __FILE__, __LINE__, &lib) || lib == NULL)
        return -1;
    if (api.library_impl(lib, "paged_cached_attention", attention_kernel))
        return -1;
    return 0;
}
