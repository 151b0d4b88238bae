// Runtime helpers callable without a device: the device count (0 without a driver) and status
// strings for the Cython error messages.
#include "common.cuh"

extern "C" int taper_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();  // clear the sticky status so later calls report their own
        return 0;
    }
    return n;
}

extern "C" const char* taper_cuda_error_string(int status) {
    if (status == TAPER_CUDA_ERR_ARG) return "arguments the kernel cannot run with";
    return cudaGetErrorString((cudaError_t)status);
}
