// A 2-D inference convolution held as one oneDNN primitive per call site (channels-last
// activations, weight prepacked once, bias, optional residual add and ReLU as post-ops).
// ATen's mkldnn::_convolution_pointwise rebuilds its ideep descriptors, attributes and
// string cache key on every call (~25-30 us at the zoo ResNet's sizes, as much as a small
// convolution's execution); here a call is the primitive's execute only.
// C ABI for ctypes: no torch headers, linked against a oneDNN v3 install. oneDNN's C API,
// not dnnl.hpp: the C++ header's templates cost 1.4 s of g++ per cold build, this 0.1 s.
#include <dnnl.h>

#include <cstdlib>
#include <vector>

namespace {

dnnl_engine_t cpu_engine() {
  static dnnl_engine_t eng = [] {
    dnnl_engine_t e = nullptr;
    return dnnl_engine_create(&e, dnnl_cpu, 0) == dnnl_success ? e : nullptr;
  }();
  return eng;
}

struct Conv {
  dnnl_primitive_desc_t pd = nullptr;
  dnnl_primitive_t prim = nullptr;
  dnnl_memory_desc_t plain_weights = nullptr;
  dnnl_memory_desc_t nchw_src = nullptr;  // an NCHW input is reordered to NHWC first
  dnnl_primitive_t to_nhwc = nullptr;
  bool has_bias = false, has_add = false;
  // the primitive's descriptors (owned by pd)
  const_dnnl_memory_desc_t src = nullptr, weights = nullptr, bias = nullptr, dst = nullptr,
                           scratch = nullptr;
};

void destroy(Conv* c) {
  if (c->to_nhwc) dnnl_primitive_destroy(c->to_nhwc);
  if (c->prim) dnnl_primitive_destroy(c->prim);
  if (c->pd) dnnl_primitive_desc_destroy(c->pd);
  if (c->plain_weights) dnnl_memory_desc_destroy(c->plain_weights);
  if (c->nchw_src) dnnl_memory_desc_destroy(c->nchw_src);
  delete c;
}

dnnl_memory_desc_t desc(int nd, const dnnl_dims_t dims, dnnl_data_type_t dt,
                        dnnl_format_tag_t tag) {
  dnnl_memory_desc_t md = nullptr;
  return dnnl_memory_desc_create_with_tag(&md, nd, dims, dt, tag) == dnnl_success ? md
                                                                                 : nullptr;
}

dnnl_memory_t wrap(const_dnnl_memory_desc_t md, const void* p) {
  dnnl_memory_t m = nullptr;
  dnnl_memory_create(&m, md, cpu_engine(), const_cast<void*>(p));
  return m;
}

// executes prim on one stream per thread with the (arg, memory) pairs, then frees them
void run(dnnl_primitive_t prim, std::vector<dnnl_exec_arg_t>& args) {
  static thread_local dnnl_stream_t st = [] {
    dnnl_stream_t s = nullptr;
    dnnl_stream_create(&s, cpu_engine(), dnnl_stream_default_flags);
    return s;
  }();
  dnnl_primitive_execute(prim, st, int(args.size()), args.data());
  dnnl_stream_wait(st);  // a no-op for oneDNN's OpenMP CPU runtime; the memories go next
  for (auto& a : args) dnnl_memory_destroy(a.memory);
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16. Returns nullptr when oneDNN has no implementation.
void* pconv_create(int dtype, long n, long c, long h, long w, long o, long kh, long kw,
                   long sh, long sw, long ph, long pw, long dh, long dw, long groups,
                   int has_bias, int relu, int has_add) {
  if (cpu_engine() == nullptr) return nullptr;
  auto dt = dtype == 1 ? dnnl_bf16 : dnnl_f32;
  long oh = (h + 2 * ph - dh * (kh - 1) - 1) / sh + 1;
  long ow = (w + 2 * pw - dw * (kw - 1) - 1) / sw + 1;
  dnnl_dims_t src_dims = {n, c, h, w}, dst_dims = {n, o, oh, ow}, bias_dims = {o};
  dnnl_dims_t wdims = {o, c, kh, kw}, gdims = {groups, o / groups, c / groups, kh, kw};
  int wnd = groups == 1 ? 4 : 5;
  auto* conv = new Conv;
  conv->has_bias = has_bias;
  conv->has_add = has_add;
  dnnl_memory_desc_t src = desc(4, src_dims, dt, dnnl_nhwc);
  dnnl_memory_desc_t dst = desc(4, dst_dims, dt, dnnl_nhwc);
  dnnl_memory_desc_t wany = desc(wnd, groups == 1 ? wdims : gdims, dt, dnnl_format_tag_any);
  dnnl_memory_desc_t bias = has_bias ? desc(1, bias_dims, dt, dnnl_a) : nullptr;
  conv->plain_weights = desc(wnd, groups == 1 ? wdims : gdims, dt,
                             groups == 1 ? dnnl_oihw : dnnl_goihw);
  conv->nchw_src = desc(4, src_dims, dt, dnnl_nchw);
  dnnl_post_ops_t po = nullptr;
  dnnl_primitive_attr_t attr = nullptr;
  bool ok = src && dst && wany && (bias || !has_bias) && conv->plain_weights &&
            conv->nchw_src && dnnl_post_ops_create(&po) == dnnl_success &&
            dnnl_primitive_attr_create(&attr) == dnnl_success;
  if (ok && has_add) ok = dnnl_post_ops_append_binary(po, dnnl_binary_add, dst) == dnnl_success;
  if (ok && relu)
    ok = dnnl_post_ops_append_eltwise(po, dnnl_eltwise_relu, 0.f, 0.f) == dnnl_success;
  if (ok)
    ok = dnnl_primitive_attr_set_post_ops(attr, po) == dnnl_success &&
         dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user) ==
             dnnl_success;
  dnnl_dims_t strides = {sh, sw}, dilates = {dh - 1, dw - 1}, pad = {ph, pw};
  if (ok)
    ok = dnnl_convolution_forward_primitive_desc_create(
             &conv->pd, cpu_engine(), dnnl_forward_inference, dnnl_convolution_direct, src,
             wany, bias, dst, strides, dilates, pad, pad, attr) == dnnl_success;
  if (ok) {
    conv->src = dnnl_primitive_desc_query_md(conv->pd, dnnl_query_src_md, 0);
    conv->weights = dnnl_primitive_desc_query_md(conv->pd, dnnl_query_weights_md, 0);
    conv->bias = has_bias ? dnnl_primitive_desc_query_md(conv->pd, dnnl_query_weights_md, 1)
                          : nullptr;
    conv->dst = dnnl_primitive_desc_query_md(conv->pd, dnnl_query_dst_md, 0);
    conv->scratch = dnnl_primitive_desc_query_md(conv->pd, dnnl_query_scratchpad_md, 0);
    ok = dnnl_primitive_create(&conv->prim, conv->pd) == dnnl_success;
  }
  dnnl_primitive_desc_t rpd = nullptr;
  if (ok)
    ok = dnnl_reorder_primitive_desc_create(&rpd, conv->nchw_src, cpu_engine(), conv->src,
                                            cpu_engine(), nullptr) == dnnl_success &&
         dnnl_primitive_create(&conv->to_nhwc, rpd) == dnnl_success;
  if (rpd) dnnl_primitive_desc_destroy(rpd);
  for (auto md : {src, dst, wany, bias})
    if (md) dnnl_memory_desc_destroy(md);
  if (attr) dnnl_primitive_attr_destroy(attr);
  if (po) dnnl_post_ops_destroy(po);
  if (!ok) {
    destroy(conv);
    return nullptr;
  }
  return conv;
}

long pconv_packed_weight_bytes(void* h) {
  return long(dnnl_memory_desc_get_size(static_cast<Conv*>(h)->weights));
}

// OIHW (or GOIHW) contiguous weight -> the primitive's blocked layout.
void pconv_pack_weight(void* h, const void* plain, void* packed) {
  auto* conv = static_cast<Conv*>(h);
  dnnl_primitive_desc_t rpd = nullptr;
  dnnl_primitive_t reorder = nullptr;
  if (dnnl_reorder_primitive_desc_create(&rpd, conv->plain_weights, cpu_engine(),
                                         conv->weights, cpu_engine(), nullptr) != dnnl_success)
    return;
  if (dnnl_primitive_create(&reorder, rpd) == dnnl_success) {
    std::vector<dnnl_exec_arg_t> args{{DNNL_ARG_FROM, wrap(conv->plain_weights, plain)},
                                      {DNNL_ARG_TO, wrap(conv->weights, packed)}};
    run(reorder, args);
    dnnl_primitive_destroy(reorder);
  }
  dnnl_primitive_desc_destroy(rpd);
}

// x_nchw: x is NCHW-contiguous (oneDNN's reorder makes it NHWC: ATen's copy is slow for
// an image's 3 channels), else NHWC.
void pconv_run(void* h, const void* x, int x_nchw, const void* packed, const void* bias,
               const void* other, void* y) {
  auto* conv = static_cast<Conv*>(h);
  // one scratchpad per thread, grown to the largest primitive's: calls on one thread run
  // one after another, and threads never share it
  static thread_local std::vector<char> scratchpad;
  size_t need = dnnl_memory_desc_get_size(conv->scratch);
  if (scratchpad.size() < need) scratchpad.resize(need);
  static thread_local std::vector<char> nhwc_input;
  if (x_nchw) {
    size_t bytes = dnnl_memory_desc_get_size(conv->src);
    if (nhwc_input.size() < bytes) nhwc_input.resize(bytes);
    std::vector<dnnl_exec_arg_t> args{{DNNL_ARG_FROM, wrap(conv->nchw_src, x)},
                                      {DNNL_ARG_TO, wrap(conv->src, nhwc_input.data())}};
    run(conv->to_nhwc, args);
    x = nhwc_input.data();
  }
  std::vector<dnnl_exec_arg_t> args{{DNNL_ARG_SRC, wrap(conv->src, x)},
                                    {DNNL_ARG_WEIGHTS, wrap(conv->weights, packed)},
                                    {DNNL_ARG_DST, wrap(conv->dst, y)},
                                    {DNNL_ARG_SCRATCHPAD, wrap(conv->scratch, scratchpad.data())}};
  if (conv->has_bias) args.push_back({DNNL_ARG_BIAS, wrap(conv->bias, bias)});
  if (conv->has_add)
    args.push_back({DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1, wrap(conv->dst, other)});
  run(conv->prim, args);
}

void pconv_destroy(void* h) { destroy(static_cast<Conv*>(h)); }

}  // extern "C"
