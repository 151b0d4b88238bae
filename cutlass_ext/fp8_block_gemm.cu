// FP8 block-wise GEMM for Hopper (issue 6, item 2; ABI in taper_cutlass.h):
//   out (M, N) bf16 = A (M, K) e4m3 x B (N, K)^T e4m3, with A scaled per token and 128-column
//   group (a_scales (M, K/128)) and B per 128 x 128 block (b_scales (ceil(N/128), K/128)).
//
// One CUTLASS 3 kernel (headers from the nvidia-cutlass wheel; the pattern is CUTLASS's example
// 67, groupwise variant): TMA loads A and B tiles into shared memory, a producer warp also copies
// the tile's scales (cp.async), and two consumer warpgroups run wgmma on FP8 operands. The trick
// is CUTLASS's block-scaled accumulation (KernelTmaWarpSpecializedCooperativeFP8Blockwise, alias
// ...FP8BlockScaledAccum): the wgmma results of one 128-deep K block (4 wgmma k-steps of 32)
// collect in a temporary accumulator, which is then multiplied by a_scale[m] * b_scale[n] of
// that block and added to the float main accumulator. Scales thus apply exactly per block in
// float, and FP8's limited-precision tensor-core accumulation never runs over more than 128
// products. The epilogue rounds the float result to bf16 and stores it with TMA.
//
// Instantiated kernels (the whole list; each costs nvcc minutes, CI allows 10 in all):
//   1. TileShape 128 x 128 x 128, cluster 1 x 1 x 1, cooperative warp-specialized schedule,
//      persistent data-parallel tile scheduler, bf16 row-major out, no C operand.
// 128 x 128 tiles are the size whose N block matches the weight's 128-row scale block (one
// b_scale per tile per K block) and whose 128-deep K tile matches the scale group. Small M
// (decode) wastes most of the 128-row tile and launches only N/128 CTAs; a 64-row pingpong tile,
// swapping A and B for M <= 64, or a stream-K schedule are the tuned alternatives, not done.
//
// Arch guard: everything CUTLASS here compiles in the host pass and in every device pass (the
// host must see the kernel type to launch it), but CUTLASS's kernel body is compiled only where
// __CUDA_ARCH_FEAT_SM90_ALL is defined, i.e. for sm_90a: the sm_80/86/89 device passes build an
// empty stub that the launcher never reaches, because it checks the device's compute capability
// (exactly 9.0) first. A plain sm_90 build (no "a") would build the stub for the H100 too, so
// that is a compile error below rather than a kernel that silently writes nothing.
//
// CUTLASS's device-side asserts (cute's smem pointer alignment checks) become calls to
// __assertfail inside the mainloop, and a call there makes ptxas serialize the wgmma pipeline
// (warning C7510); release builds of CUTLASS compile with NDEBUG, so this file does too, before
// any header sees assert.
#ifndef NDEBUG
#define NDEBUG
#endif

#include "common.cuh"
#include "taper_cutlass.h"

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/device_kernel.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/util/packed_stride.hpp"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "fp8_block_gemm.cu needs sm_90a for Hopper (TAPER_CUDA_ARCHS 90a, not 90)"
#endif

#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)  // CUDA 12+ (host and every device pass)
#define TAPER_HAVE_FP8_BLOCK_GEMM 1

// A named namespace, not an anonymous one: the kernel is instantiated on these types and nvcc's
// generated host stub cannot name an anonymous namespace unambiguously here.
namespace taper_fp8_block_gemm {

using namespace cute;

// ---- kernels (CUTLASS types; the one instantiation listed in the header comment)

using ElementA = cutlass::float_e4m3_t;  // activations (M, K), K contiguous
using ElementB = cutlass::float_e4m3_t;  // weight (N, K), K contiguous
using ElementD = cutlass::bfloat16_t;    // out (M, N), N contiguous
using ElementAccumulator = float;        // also the scales' type (CUTLASS requires the same)
using ElementCompute = float;

// CUTLASS names GEMM operands as A (M x K) and B (K x N): our (N, K) row-major weight is B in
// column-major, and both operands are K-major, the layout FP8 wgmma reads from shared memory.
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = cutlass::layout::RowMajor;
// TMA moves 16-byte units: 16 e4m3 codes per row step of A and B, 8 bf16 of out.
constexpr int kAlignA = 16;
constexpr int kAlignB = 16;
constexpr int kAlignD = 8;

using TileShape = Shape<_128, _128, _128>;
// No clusters (no TMA multicast between CTAs): the simplest launch, a plain <<<>>> with no
// cluster attribute; multicasting B across a 1 x 2 cluster is a tuning step for large M.
using ClusterShape = Shape<_1, _1, _1>;

// Scale granularity (M, N, K) = (1, 128, 128): one A scale per token and 128-column group, one
// B scale per 128 x 128 block. Both scale tensors are K-major (row-major (M, K/128) and
// (N/128, K/128)), the layouts the quantizer and the checkpoints produce; CUTLASS then loads the
// tile's scales with cp.async instead of TMA (TMA for SFA wants it M-major), which costs a few
// strided 4-byte loads per 128 x 128 x 128 tile step.
constexpr int kGroup = 128;
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kGroup, kGroup,
                                                              cute::GMMA::Major::K,
                                                              cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementCompute,
    void, LayoutD, kAlignD,  // no C operand: D = alpha * acc (alpha 1)
    ElementD, LayoutD, kAlignD, cutlass::epilogue::TmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<ElementD, ElementCompute, void,
                                                 ElementCompute>>::CollectiveOp;

// Stages: as many as shared memory holds after the epilogue's share (the builder's carve-out).
using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    ElementA, cute::tuple<LayoutA, LayoutSFA>, kAlignA,
    ElementB, cute::tuple<LayoutB, LayoutSFB>, kAlignB,
    ElementAccumulator, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;

// void scheduler: the persistent data-parallel one (a grid of about one CTA per SM walking the
// output tiles; no workspace).
using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>,
                                                        CollectiveMainloop, CollectiveEpilogue,
                                                        void>;

using StrideA = typename GemmKernel::StrideA;
using StrideB = typename GemmKernel::StrideB;
using StrideD = typename GemmKernel::StrideD;

// The arguments for one call; pointers may be null (workspace query). sm_count 0 would make
// CUTLASS query the device itself; the launcher passes the count it read.
static GemmKernel::Arguments make_arguments(const uint8_t* a,       // (M, K) e4m3
                                            const float* a_scales,  // (M, K / 128)
                                            const uint8_t* b,       // (N, K) e4m3
                                            const float* b_scales,  // (ceil(N / 128), K / 128)
                                            void* out,              // (M, N) bf16
                                            int M, int N, int K, int device, int sm_count) {
    const StrideA stride_a = cutlass::make_cute_packed_stride(StrideA{}, make_shape(M, K, 1));
    const StrideB stride_b = cutlass::make_cute_packed_stride(StrideB{}, make_shape(N, K, 1));
    const StrideD stride_d = cutlass::make_cute_packed_stride(StrideD{}, make_shape(M, N, 1));
    const LayoutSFA layout_sfa = ScaleConfig::tile_atom_to_shape_SFA(make_shape(M, N, K, 1));
    const LayoutSFB layout_sfb = ScaleConfig::tile_atom_to_shape_SFB(make_shape(M, N, K, 1));
    GemmKernel::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {M, N, K, 1},
        {reinterpret_cast<const ElementA*>(a), stride_a, reinterpret_cast<const ElementB*>(b),
         stride_b, a_scales, layout_sfa, b_scales, layout_sfb},
        {{},  // epilogue.thread: alpha, beta set below
         nullptr, stride_d, reinterpret_cast<ElementD*>(out), stride_d}};
    args.epilogue.thread.alpha = 1.f;
    args.epilogue.thread.beta = 0.f;
    args.hw_info.device_id = device;
    args.hw_info.sm_count = sm_count;
    return args;
}

// Shapes the kernel runs (see taper_cutlass.h): whole K tiles and scale groups, 16-byte rows.
static bool shape_ok(int64_t M, int64_t N, int64_t K) {
    return M > 0 && N > 0 && K > 0 && M <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX &&
           K % kGroup == 0 && N % kAlignD == 0;
}

// The current device, its SM count, and whether it is compute capability 9.0 (the only one that
// runs sm_90a code). Attribute queries neither allocate nor synchronize.
static int query_device(int* device, int* sm_count, bool* is_sm90) {
    int major = 0, minor = 0;
    cudaError_t e = cudaGetDevice(device);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, *device);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, *device);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(sm_count, cudaDevAttrMultiProcessorCount, *device);
    if (e != cudaSuccess) {
        cudaGetLastError();  // not a sticky error: clear it, so the next launch reports its own
        return (int)e;
    }
    *is_sm90 = major == 9 && minor == 0;
    return 0;
}

}  // namespace taper_fp8_block_gemm
using namespace taper_fp8_block_gemm;
#endif  // CUTLASS_ARCH_MMA_SM90_SUPPORTED

// ---- launchers

extern "C" int64_t taper_cutlass_fp8_block_gemm_workspace_bytes(int64_t M, int64_t N, int64_t K) {
#if defined(TAPER_HAVE_FP8_BLOCK_GEMM)
    if (!shape_ok(M, N, K)) return 0;
    int device = 0, sm_count = 0;
    bool is_sm90 = false;
    if (query_device(&device, &sm_count, &is_sm90) || !is_sm90) return 0;
    const GemmKernel::Arguments args = make_arguments(nullptr, nullptr, nullptr, nullptr, nullptr,
                                                      (int)M, (int)N, (int)K, device, sm_count);
    return (int64_t)GemmKernel::get_workspace_size(args);
#else
    (void)M, (void)N, (void)K;
    return 0;
#endif
}

extern "C" int taper_cutlass_fp8_block_gemm(const uint8_t* a, const float* a_scales,
                                            const uint8_t* b, const float* b_scales, void* out,
                                            int64_t M, int64_t N, int64_t K, void* workspace,
                                            int64_t workspace_bytes, taper_stream_t stream) {
#if defined(TAPER_HAVE_FP8_BLOCK_GEMM)
    if (M < 0 || N < 0 || K < 0) return TAPER_CUDA_ERR_ARG;
    if (M == 0 || N == 0) return TAPER_CUDA_OK;
    if (!shape_ok(M, N, K)) return TAPER_CUDA_ERR_ARG;
    if (!taper::aligned16(a) || !taper::aligned16(b) || !taper::aligned16(out) ||
        ((uintptr_t)a_scales & 3) || ((uintptr_t)b_scales & 3))
        return TAPER_CUDA_ERR_ARG;
    int device = 0, sm_count = 0;
    bool is_sm90 = false;
    if (int e = query_device(&device, &sm_count, &is_sm90)) return e;
    if (!is_sm90) return TAPER_CUDA_ERR_ARG;  // this device lacks sm90a: use the bf16 fallback

    const GemmKernel::Arguments args = make_arguments(a, a_scales, b, b_scales, out, (int)M,
                                                      (int)N, (int)K, device, sm_count);
    const size_t need = GemmKernel::get_workspace_size(args);
    if (workspace_bytes < 0 || (size_t)workspace_bytes < need || (need && !workspace))
        return TAPER_CUDA_ERR_ARG;
    if (!GemmKernel::can_implement(args)) return TAPER_CUDA_ERR_ARG;
    // What CUTLASS's GemmUniversalAdapter initialize() + run() do, done here so that a failing
    // CUDA call's own error comes back (the adapter clears it and reports kErrorInternal).
    cudaStream_t s = (cudaStream_t)stream;
    if (GemmKernel::initialize_workspace(args, workspace, s) != cutlass::Status::kSuccess) {
        const int e = taper::launch_status();  // nothing to initialize with this scheduler
        return e ? e : (int)cudaErrorUnknown;
    }
    // The kernel parameters: problem, strides and the TMA descriptors, encoded on the host by the
    // driver (cuTensorMapEncodeTiled through cudaGetDriverEntryPoint: no device work).
    const GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, workspace);
    // Over 48 KB of dynamic shared memory (the pipeline stages) needs the opt-in attribute; it is
    // a property of the function, set on every call (cheap, and no state kept here).
    constexpr int smem = GemmKernel::SharedStorageSize;
    const cudaError_t e = cudaFuncSetAttribute(cutlass::device_kernel<GemmKernel>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return (int)e;  // e.g. no sm_90a image in this build
    }
    const dim3 grid = GemmKernel::get_grid_shape(params);  // persistent: <= one CTA per SM
    const dim3 block = GemmKernel::get_block_shape();       // 384: producer + 2 MMA warpgroups
    cutlass::device_kernel<GemmKernel><<<grid, block, smem, s>>>(params);
    return taper::launch_status();
#else
    (void)a, (void)a_scales, (void)b, (void)b_scales, (void)out, (void)M, (void)N, (void)K;
    (void)workspace, (void)workspace_bytes, (void)stream;
    return TAPER_CUDA_ERR_ARG;  // built with a CUDA older than 12: no Hopper kernels
#endif
}
