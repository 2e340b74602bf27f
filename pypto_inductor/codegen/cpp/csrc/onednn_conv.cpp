// A 2-D inference convolution held as one oneDNN primitive per call site (channels-last
// activations, weight prepacked once, bias, optional residual add and ReLU as post-ops).
// ATen's mkldnn::_convolution_pointwise rebuilds its ideep descriptors, attributes and
// string cache key on every call (~25-30 us at the zoo ResNet's sizes, as much as a small
// convolution's execution); here a call is the primitive's execute only.
// C ABI for ctypes: no torch headers, linked against a oneDNN v3 install.
#include <dnnl.hpp>
#include <omp.h>
#include <unordered_map>
#include <vector>

namespace {

using dnnl::memory;

dnnl::engine& cpu_engine() {
  static dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  return eng;
}

struct Conv {
  dnnl::convolution_forward::primitive_desc pd;
  dnnl::convolution_forward prim;
  memory::desc plain_weights;
  bool has_bias, has_add;
  memory::desc nchw_src;  // an NCHW input is reordered to the primitive's NHWC first
  dnnl::reorder to_nhwc;
};

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16. Returns nullptr when oneDNN has no implementation.
void* pconv_create(int dtype, long n, long c, long h, long w, long o, long kh, long kw,
                   long sh, long sw, long ph, long pw, long dh, long dw, long groups,
                   int has_bias, int relu, int has_add) {
  try {
    auto dt = dtype == 1 ? memory::data_type::bf16 : memory::data_type::f32;
    long oh = (h + 2 * ph - dh * (kh - 1) - 1) / sh + 1;
    long ow = (w + 2 * pw - dw * (kw - 1) - 1) / sw + 1;
    memory::desc src({n, c, h, w}, dt, memory::format_tag::nhwc);
    memory::desc dst({n, o, oh, ow}, dt, memory::format_tag::nhwc);
    memory::dims wdims = groups == 1 ? memory::dims{o, c, kh, kw}
                                     : memory::dims{groups, o / groups, c / groups, kh, kw};
    memory::desc wany(wdims, dt, memory::format_tag::any);
    memory::desc plain(wdims, dt, groups == 1 ? memory::format_tag::oihw
                                              : memory::format_tag::goihw);
    memory::desc bias({o}, dt, memory::format_tag::a);
    dnnl::post_ops po;
    if (has_add) po.append_binary(dnnl::algorithm::binary_add, dst);
    if (relu) po.append_eltwise(dnnl::algorithm::eltwise_relu, 0.f, 0.f);
    dnnl::primitive_attr attr;
    attr.set_post_ops(po);
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    auto pd = has_bias
        ? dnnl::convolution_forward::primitive_desc(
              cpu_engine(), dnnl::prop_kind::forward_inference,
              dnnl::algorithm::convolution_direct, src, wany, bias, dst, {sh, sw},
              {dh - 1, dw - 1}, {ph, pw}, {ph, pw}, attr)
        : dnnl::convolution_forward::primitive_desc(
              cpu_engine(), dnnl::prop_kind::forward_inference,
              dnnl::algorithm::convolution_direct, src, wany, dst, {sh, sw},
              {dh - 1, dw - 1}, {ph, pw}, {ph, pw}, attr);
    memory::desc nchw({n, c, h, w}, dt, memory::format_tag::nchw);
    auto* conv = new Conv{pd, dnnl::convolution_forward(pd), plain, bool(has_bias),
                          bool(has_add), nchw,
                          dnnl::reorder(dnnl::reorder::primitive_desc(
                              cpu_engine(), nchw, cpu_engine(), src))};
    return conv;
  } catch (const dnnl::error&) {
    return nullptr;
  }
}

long pconv_packed_weight_bytes(void* h) {
  return long(static_cast<Conv*>(h)->pd.weights_desc().get_size());
}

// OIHW (or GOIHW) contiguous weight -> the primitive's blocked layout.
void pconv_pack_weight(void* h, const void* plain, void* packed) {
  auto* conv = static_cast<Conv*>(h);
  dnnl::stream st(cpu_engine());
  memory src(conv->plain_weights, cpu_engine(), const_cast<void*>(plain));
  memory dst(conv->pd.weights_desc(), cpu_engine(), packed);
  dnnl::reorder(src, dst).execute(st, src, dst);
  st.wait();
}

// x_nchw: x is NCHW-contiguous (oneDNN's reorder makes it NHWC: ATen's copy is slow for
// an image's 3 channels), else NHWC.
void pconv_run(void* h, const void* x, int x_nchw, const void* packed, const void* bias,
               const void* other, void* y) {
  auto* conv = static_cast<Conv*>(h);
  auto& eng = cpu_engine();
  static thread_local dnnl::stream st(eng);
  // one scratchpad per thread, grown to the largest primitive's: calls on one thread run
  // one after another, and threads never share it
  static thread_local std::vector<char> scratchpad;
  size_t need = conv->pd.scratchpad_desc().get_size();
  if (scratchpad.size() < need) scratchpad.resize(need);
  static thread_local std::vector<char> nhwc_input;
  if (x_nchw) {
    size_t bytes = conv->pd.src_desc().get_size();
    if (nhwc_input.size() < bytes) nhwc_input.resize(bytes);
    memory from(conv->nchw_src, eng, const_cast<void*>(x));
    memory to(conv->pd.src_desc(), eng, nhwc_input.data());
    conv->to_nhwc.execute(st, from, to);
    x = nhwc_input.data();
  }
  std::unordered_map<int, memory> args{
      {DNNL_ARG_SRC, memory(conv->pd.src_desc(), eng, const_cast<void*>(x))},
      {DNNL_ARG_WEIGHTS, memory(conv->pd.weights_desc(), eng, const_cast<void*>(packed))},
      {DNNL_ARG_DST, memory(conv->pd.dst_desc(), eng, y)},
      {DNNL_ARG_SCRATCHPAD, memory(conv->pd.scratchpad_desc(), eng, scratchpad.data())}};
  if (conv->has_bias)
    args.emplace(DNNL_ARG_BIAS, memory(conv->pd.bias_desc(), eng, const_cast<void*>(bias)));
  if (conv->has_add)
    args.emplace(DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1,
                 memory(conv->pd.dst_desc(), eng, const_cast<void*>(other)));
  conv->prim.execute(st, args);
}

void pconv_destroy(void* h) { delete static_cast<Conv*>(h); }

}  // extern "C"
