// The jacobi_ext._C extension module and the schemas of every torch.ops.jacobi_ext operator.
//
// All schemas live here, in one place; each *_ops.cpp file registers the CPU implementation of
// its ops and each *_ops_cuda.cpp the CUDA one, under the same names. An op is named by what it
// computes (rms_norm, rope_attention, kv_commit, argmax, ...); a cpu_ prefix marks an op that
// exists on the CPU only (the packed linears, the CPU step's mask and verify passes). The Python side
// (jacobi_ext/ops.py) adds the fake (meta) kernels and autograd formulas.
//
// One class is registered beside its code instead: torch.classes.jacobi_ext.LeanLayers
// (lean_ops.cpp), a lean forward's layers in one call.
//
// The module links no libtorch_python: importing it only has to run the static registrations
// below, so PyInit creates a bare module that carries a few build facts as attributes.
#include <Python.h>
#include <torch/library.h>

#include "cpu/isa.h"
#include "cpu/linear_gguf_cpu.h"

TORCH_LIBRARY(jacobi_ext, m) {
  // Training attention over a block-causal layout (visibility: csrc/include/jacobi/block_table.h).
  // q [B, Hq, S, D]; k, v [B, Hkv, S, D] (Hq % Hkv == 0); block table tensors int32 on q's device.
  // Returns out [B, Hq, S, D] (q's dtype) and the log-sum-exp lse [B, Hq, S] (float32).
  // kernel: the kernel family to run (cpu, sm80, sm90; csrc/torch/attention_kernel.h), which
  // jacobi_ext/attention.py picks (default, JACOBI_ATTN_KERNEL) and passes by name; None or
  // 'auto' run the portable kernel of q's device (cpu on CPU, sm80 on CUDA): the op never reads
  // the environment. tile_lists: where the sm_90a kernel runs, the 8 outputs of
  // attention_tile_lists(block_start, kv_ptr, kv_idx, S, 128, 128) on q's device, built once per
  // table (None or empty: the op builds them, copying the table to the host; other kernels
  // ignore them). The backward takes the same lists (autograd passes the forward's), read where
  // the sm_90a backward runs.
  m.def(
      "block_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor block_start, Tensor kv_ptr, "
      "Tensor kv_idx, float scale, str? kernel=None, Tensor[]? tile_lists=None) -> "
      "(Tensor out, Tensor lse)");
  m.def(
      "block_attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, Tensor block_start, Tensor kv_ptr, Tensor kv_idx, float scale, "
      "bool deterministic, str? kernel=None, Tensor[]? tile_lists=None) -> "
      "(Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  // The kernel family block_attention_fwd/bwd run for q with this `kernel` argument: "cpu",
  // "sm80" or "sm90" (the family that actually runs, after the fallbacks; for benchmarks).
  m.def("attention_kernel(Tensor q, str? kernel=None) -> str");
  // The family block_attention_bwd runs for q with this `kernel` and `deterministic`: "cpu",
  // "sm80" or "sm90" (the sm_90a backward: kernel sm90 in use and an sm_90a backward for q's
  // dtype and head dim, deterministic or not; otherwise the sm_80 backward runs).
  m.def("attention_bwd_kernel(Tensor q, bool deterministic, str? kernel=None) -> str");
  // The same with the table in a processing order that differs from the memory order: block b
  // (of the table) lives at memory rows [block_row[b], block_row[b] + its length). The tokens
  // are reordered inside the kernel's own copy passes, at no extra cost, so a layout can be
  // processed in the order where its visible key blocks are contiguous (Jacobi Forcing: "stream
  // order", see jacobi_ext/layout.py) while q, k, v, out and the grads stay in memory order.
  // block_row: int32 [num_blocks], a permutation of the blocks' memory ranges.
  m.def(
      "block_attention_ordered_fwd(Tensor q, Tensor k, Tensor v, Tensor block_start, "
      "Tensor kv_ptr, Tensor kv_idx, Tensor block_row, float scale) -> (Tensor out, Tensor lse)");
  m.def(
      "block_attention_ordered_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, Tensor block_start, Tensor kv_ptr, Tensor kv_idx, Tensor block_row, "
      "float scale, bool deterministic) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  // The Jacobi Forcing block table (docs/method.md §1), built from JfLayout in block_table.h so
  // that the visibility rule is stated once. variant: 0 noisy_context, 1 clean_context, 2
  // windowed (window = pairs per window; ignored otherwise). int32 tensors on the CPU.
  m.def(
      "jf_block_table(int prompt_len, int block_size, int num_pairs, int variant, int window) -> "
      "(Tensor block_start, Tensor kv_ptr, Tensor kv_idx)");
  // Decoding: one verify-accept-recycle step over the packed rows of a forward
  // (semantics: csrc/include/jacobi/verify.h). pool / pool_len / pool_head are updated in place.
  // One sequence (tokens [rows, width], ...) or a batch in one launch (every tensor, inputs and
  // outputs, with a leading [batch]; a sequence with row_len[b][0] == 0 takes no part).
  m.def(
      "verify_step(Tensor tokens, Tensor greedy, Tensor row_len, Tensor block_ends, "
      "Tensor init_tokens, Tensor(a!) pool, Tensor(b!) pool_len, Tensor(c!) pool_head, "
      "int spawn_threshold, int eos_token_id) -> "
      "(Tensor accept, Tensor summary, Tensor commit, Tensor next_tokens, "
      "Tensor next_block_ends, Tensor candidates, Tensor candidate_len)");
  // Decoding under sampling: the token each row of logits [batch, positions, vocab] predicts,
  // argmax of the filtered (temperature, top_k, top_p, min_p, in transformers' order),
  // temperature-scaled logits plus Gumbel noise keyed by (keys[b] = (seed, stream), positions[b][i]
  // = the absolute position of the predicted token, vocab index) (semantics:
  // csrc/include/jacobi/sampling.h). top_k 0, top_p 1, min_p 0: off. Returns int64 [batch, positions].
  m.def(
      "gumbel_argmax(Tensor logits, Tensor keys, Tensor positions, float temperature, int top_k, "
      "float top_p, float min_p) -> Tensor");
  // The noise itself, materialised [batch, positions, vocab] float64 (tests only: the decoding
  // never stores it): the uniforms u in (0, 1) (uniform=true) or the Gumbel noise -log(-log u).
  m.def("debug_gumbel_noise(Tensor keys, Tensor positions, int vocab, bool uniform) -> Tensor");
  // The greedy pick over the last dim, int64 [...]: the first NaN, else the first maximum
  // (torch.max(-1).indices' choice), rows split into chunks read in parallel (CPU).
  m.def("argmax(Tensor logits) -> Tensor");
  // Decode-shaped linear on the CPU (csrc/cpu/linear_cpu.h): y = x W^T (+ bias) for float32 or
  // bfloat16, from a weight packed once by cpu_linear_pack (weight [N, K] -> panels
  // [ceil(N / NR), K or K rounded up to even, NR], in the layout of this CPU's kernels). Each
  // output is one fp32 chain over k in order, so a row's result does not depend on the others.
  // bias: [N], float32 or x's dtype. cpu_linear_info names the ISA, layout and NR in use.
  m.def("cpu_linear_pack(Tensor weight) -> Tensor");
  // The same for the concatenation of weights [N_i, K] along the output features (fused q/k/v,
  // gate/up), without materialising it.
  m.def("cpu_linear_pack_cat(Tensor[] weights) -> Tensor");
  m.def("cpu_linear(Tensor x, Tensor packed, int out_features, Tensor? bias=None) -> Tensor");
  m.def("cpu_linear_info(ScalarType dtype) -> str");
  // The same linear on GGUF weights as the file stores them (csrc/cpu/linear_gguf_cpu.h): rows
  // uint8 [N_i, bytes per row] of ggml type `type` (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) packed
  // once (several weights side by side: their concatenation along the outputs), then x float32
  // times that. Each weight dequantizes to bitwise the `gguf` package's value, and each output is
  // the fp32 kernel's chain on those values: bitwise cpu_linear on the dequantized weight.
  m.def("cpu_linear_gguf_pack(Tensor[] weights, int type) -> Tensor");
  // lora_a / lora_b: an unmerged LoRA, y += (x A^T) B^T, A [rank, K] and B [N, rank] (the scale
  // folded in); B in panels [ceil(N / NR), rank, NR] (cpu_linear_pack), A in panels one vector
  // wide, [ceil(rows / VL), K, VL], VL = NR / 2 (cpu_lora_pack_a in jacobi_ext.kernels.ops); both
  // float32 or both bfloat16 (widened exactly in the kernel: the same bits as their float32
  // values); added after the bias. lora_panel_r0
  // (int64, one per panel of NR outputs): A has any number of rows, and panel p of B multiplies
  // columns [r0[p], r0[p] + rank) of x A^T (linears side by side, each its own columns).
  // int8_activations: Q4_1 and Q8_0, each row of x quantized to 8 bits per group of 32 and integer
  // dot products per group (linear_gguf_cpu.h: linear_gguf_int8): not the dequantized fp32
  // product, but the same bits for a row at any M and on every ISA.
  m.def("cpu_linear_gguf(Tensor x, Tensor packed, int type, int out_features, "
        "Tensor? bias=None, Tensor? lora_a=None, Tensor? lora_b=None, "
        "Tensor? lora_panel_r0=None, bool int8_activations=False) -> Tensor");
  m.def("cpu_linear_gguf_types() -> int[]");
  // The out= forms of the CPU step's ops: the C++ *_out functions LeanLayers calls
  // (cpu_step_ops.h), the same kernels on the same values (the same bits) into outputs the caller
  // keeps. Each output must be a contiguous CPU tensor with as many elements of the result's
  // dtype as the result (any shape: it is not resized); it is returned.
  m.def("cpu_linear.out(Tensor x, Tensor packed, int out_features, Tensor? bias=None, *, "
        "Tensor(a!) out) -> Tensor(a!)");
  m.def("cpu_linear_gguf.out(Tensor x, Tensor packed, int type, int out_features, "
        "Tensor? bias=None, Tensor? lora_a=None, Tensor? lora_b=None, "
        "Tensor? lora_panel_r0=None, bool int8_activations=False, *, Tensor(a!) out) "
        "-> Tensor(a!)");
  // The greedy form of an exact Q4_1 / Q8_0 linear (an LM head): argmax over the outputs of
  // cpu_linear_gguf(x, packed, type, out_features), int64 [...], bitwise that argmax, found
  // through an 8-bit product and a rigorous error bound per column (csrc/include/jacobi/
  // greedy_screen.h), the exact product on the few columns that can win. abs_sums: float32
  // [out_features + 1], each column's sum of weight magnitudes (rounded up), then their maximum.
  m.def("cpu_linear_gguf_abs_sums(Tensor packed, int type, int out_features, int in_features) "
        "-> Tensor");
  m.def("cpu_linear_gguf_greedy(Tensor x, Tensor packed, int type, int out_features, "
        "Tensor abs_sums) -> Tensor");
  // Its screen, for tests: per row of x [M, K] the approximate outputs [M, N], their error bounds
  // [M, N] and the number of candidates (-1: the row takes the whole exact product).
  m.def("debug_greedy_screen(Tensor x, Tensor packed, int type, int out_features, "
        "Tensor abs_sums) -> (Tensor, Tensor, Tensor)");
  // uint8 [nbytes] for a model's packed codes and LoRA factors, all in one buffer: at a 2 MiB
  // boundary, on transparent huge pages where the OS grants them (Linux; else an ordinary CPU
  // tensor).
  m.def("cpu_weight_arena(int nbytes) -> Tensor");
  // Rows ids of a Q8_0 matrix as the file stores it (uint8 [V, blocks * 34]), dequantized to
  // float32 [*ids.shape, blocks * 32] bitwise as the `gguf` package does (a token embedding).
  m.def("cpu_gguf_q8_0_rows(Tensor raw, Tensor ids) -> Tensor");
  // The small ops of a decoding step, fused (CPU: csrc/cpu/decode_cpu.h; CUDA, where a twin
  // exists: csrc/cuda/decode_cuda.cu), float32 or bfloat16, each row computed alone (no
  // dependence on the other rows of the call):
  // attention of q [B, Hq, Q, D] over k, v [B, Hkv, W, D] (Hq % Hkv == 0) where mask [B, 1, Q, W]
  // (bool) allows, out [B, Q, Hq, D]; and transformers' RMSNorm of x [..., n] with weight [n].
  // With float32 q, k and v may be float16 (a half K/V cache: widened exactly where read).
  m.def("cpu_decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  // h = residual + x and its RMSNorm, in one pass; silu(gate) * up of gu [..., 2n] (gate then up).
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> "
        "(Tensor h, Tensor y)");
  m.def("silu_and_mul(Tensor gu) -> Tensor");
  // (their out= forms on a CPU, as cpu_linear.out's)
  m.def("fused_add_rms_norm.out(Tensor x, Tensor residual, Tensor weight, float eps, *, "
        "Tensor(a!) h, Tensor(b!) y) -> (Tensor(a!), Tensor(b!))");
  m.def("silu_and_mul.out(Tensor gu, *, Tensor(a!) out) -> Tensor(a!)");
  // Qwen3's q/k norms: the RMSNorm of each q head (q_weight [D]) and k head (k_weight [D]) of
  // qkv [..., (heads + 2 kv_heads) D], in place, before the rotary (the v heads untouched).
  m.def("qk_rms_norm_(Tensor(a!) qkv, int heads, int kv_heads, Tensor q_weight, Tensor k_weight, "
        "float eps) -> ()");
  // The attention block of a decoding step from the fused q/k/v projection qkv [B, Q, (heads +
  // 2 kv_heads) D]: q and k rotated by cos, sin [B, Q, D] as transformers' apply_rotary_pos_emb
  // does, k and v written into the caches [B, kv_heads, capacity, D] at slots[i] (in place),
  // then attention over cache slots [0, attend) where mask [B, 1, Q, attend] allows.
  // kt_cache: optional, the keys kept transposed in float32 blocks [B, kv_heads, L / 16, D, 16]
  // (L >= capacity), written with k_cache and attended from (bitwise the same result).
  // With float32 qkv the caches may be float16 (kt_cache too): k and v rounded as written.
  // context_start: slots [context_start, attend) hold the context in position order and
  // [0, context_start) the step's tokens after it; the softmax sum and p V run in that order, so
  // a row's result does not depend on where its keys sit in the cache. Returns [B, Q, heads, D].
  m.def("cpu_rope_attention(Tensor qkv, int heads, int kv_heads, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, int attend, Tensor mask, "
        "float scale, Tensor(c!)? kt_cache=None, int context_start=0) -> Tensor");
  m.def("cpu_rope_attention.out(Tensor qkv, int heads, int kv_heads, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, int attend, Tensor mask, "
        "float scale, Tensor(c!)? kt_cache=None, int context_start=0, *, Tensor(d!) out) "
        "-> Tensor(d!)");
  // The attention block of a decoding step from the step plan itself (no mask): as
  // cpu_rope_attention, with query i's k and v written to scratch slot i, and query i seeing the
  // committed slots [lo[b], hi[b]) and the scratch slots of its own row (seg [B, Q], -1:
  // padding) at offsets (off [B, Q]) up to its own (jacobi/decode_step.h: step_sees_*; the rule
  // of jacobi_ext.decoding.masks.step_mask). On CUDA nothing is read on the host and only
  // slots up to hi[b] are read (device-side lengths: capturable in a CUDA graph); the CPU twin
  // builds the mask and calls cpu_rope_attention. Returns [B, Q, heads, D].
  m.def("rope_attention(Tensor qkv, int heads, int kv_heads, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor seg, Tensor off, Tensor lo, Tensor hi, "
        "float scale) -> Tensor");
  // The decoding step's commit (CPU and CUDA): in every cache [B, H, capacity, D] of caches, for each
  // sequence b, the slots [src[b], src[b] + count[b]) move to [dst[b], dst[b] + count[b]) (as one
  // gather then scatter: the ranges may overlap). One call for all layers, in place. transposed:
  // keys kept as cpu_rope_attention's kt_cache [B, H, L / 16, D, 16], whose slots move alike.
  m.def("kv_commit(Tensor(a!)[] caches, Tensor src, Tensor dst, Tensor count, "
        "Tensor(b!)[] transposed) -> ()");
  // The step's attention mask on a CPU in one pass, bool [B, 1, Q, width]: what
  // jacobi_ext.decoding.masks.step_mask builds from seg, off [B, Q] and lo, hi [B] (int64) in ~15
  // tensor ops (its docstring has the rule; tests compare the two).
  m.def("cpu_step_mask(Tensor seg, Tensor off, Tensor lo, Tensor hi, int width) -> Tensor");
  // The parallel sequences' side of a step, in one call (step.py: BatchStep._verify; CPU and
  // CUDA, jacobi/verify_rows.h): rows cut from toks / tgt, verify_step, the next state into
  // src, block_ends, the pool, ctx and ctx_len (in place), and (packed step rows, winner rows'
  // first queries, tokens committed, taking part) (the rows' layout: jacobi/step_row.h).
  m.def("verify_rows(Tensor toks, Tensor tgt, Tensor row_start, Tensor row_len, "
        "Tensor init_idx, Tensor(a!) src, Tensor(b!) block_ends, Tensor(c!) pool, "
        "Tensor(d!) pool_len, Tensor(e!) pool_head, Tensor(f!) ctx, Tensor(g!) ctx_len, "
        "int spawn_threshold, int eos_token_id, int width) -> (Tensor, Tensor, Tensor, Tensor)");
  // The step's AR rows, one pass (jacobi/step_row.h: ar_step_row, the one AR acceptance): per
  // sequence b of toks, tgt [B, Q] (the fed tokens and their targets) with fed[b] tokens fed,
  // its step row [kSummarySize + width + tail] (summary, commit slots, zeros) and the tokens to
  // commit (0 where fed[b] is 0). eos: the EOS ids (None: none). int64, on toks' device.
  m.def("ar_accept(Tensor toks, Tensor tgt, Tensor fed, Tensor? eos, int width, int tail) "
        "-> (Tensor rows, Tensor count)");
  // The step row's layout, declared in jacobi/step_row.h and read by Python from here
  // (jacobi_ext/decoding/step_row.py): the summary's field names, comma-separated, and the
  // offsets [commit, block_ends, candidate_len, accept, next_block, candidates, size] of a row
  // for these sizes.
  m.def("step_summary_fields() -> str");
  m.def("step_row_layout(int width, int num_blocks, int pool_size, int rows, int block_size) "
        "-> int[]");
}

namespace {

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "jacobi_ext native operators", -1,
                          nullptr};

}  // namespace

extern "C" __attribute__((visibility("default"))) PyObject* PyInit__C() {
  PyObject* mod = PyModule_Create(&module_def);
  if (mod == nullptr) return nullptr;
  PyModule_AddStringConstant(mod, "torch_version", JACOBI_EXT_TORCH_VERSION);
#ifdef JACOBI_WITH_CUDA
  PyModule_AddIntConstant(mod, "with_cuda", 1);
  PyModule_AddStringConstant(mod, "cuda_archs", JACOBI_EXT_CUDA_ARCHS);  // "sm_80, sm_90a"
  // full (every dtype and head dim), ci (bf16 only) or gate (bf16, head dim 128): CMake's
  // JACOBI_EXT_CUDA_KERNELS, so tests tell a kernel this build left out from a failing one.
  PyModule_AddStringConstant(mod, "cuda_kernel_set", JACOBI_EXT_CUDA_KERNEL_SET);
#else
  PyModule_AddStringConstant(mod, "cuda_kernel_set", "");
  PyModule_AddIntConstant(mod, "with_cuda", 0);
  PyModule_AddStringConstant(mod, "cuda_archs", "");
#endif
  try {
    PyModule_AddStringConstant(mod, "cpu_isa", jacobi::cpu::isa_name(jacobi::cpu::active_isa()));
    PyModule_AddStringConstant(mod, "cpu_int8_tile", JACOBI_CPU_DISPATCH(linear_gguf_int8_tile));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    Py_DECREF(mod);
    return nullptr;
  }
  return mod;
}
