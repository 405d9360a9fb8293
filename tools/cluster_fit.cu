// cluster_fit.cu: how many thread-block clusters of each size this GPU holds at once, for blocks shaped like the
// key-quarter attention kernel's (threads, dynamic shared memory). A diagnostic for DFLASH_ATTN_CLUSTER:
//   nvcc -O2 -arch=sm_90 tools/cluster_fit.cu -o /tmp/cluster_fit && /tmp/cluster_fit
#include <cstdio>
#include <cuda_runtime.h>

__global__ void probe_kernel() {}

int main() {
    int device = 0, sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cudaFuncSetAttribute(probe_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    cudaFuncSetAttribute(probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
    std::printf("%d SMs\n", sms);
    const struct { int threads; size_t smem; const char *what; } shapes[] = {
        {512, 141824, "head_dim 128, 4 m tiles (verify)"}, {128, 75008, "head_dim 128, 1 m tile (decode)"}};
    for (const auto &sh : shapes) {
        std::printf("%s: %d threads, %zu bytes:", sh.what, sh.threads, sh.smem);
        for (int size = 1; size <= 16; size *= 2) {
            cudaLaunchAttribute attr;
            attr.id = cudaLaunchAttributeClusterDimension;
            attr.val.clusterDim.x = 1;
            attr.val.clusterDim.y = unsigned(size);
            attr.val.clusterDim.z = 1;
            cudaLaunchConfig_t config = {};
            config.gridDim = dim3(1, unsigned(size), 1);
            config.blockDim = dim3(unsigned(sh.threads));
            config.dynamicSmemBytes = sh.smem;
            config.attrs = &attr;
            config.numAttrs = 1;
            int clusters = 0;
            const cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, probe_kernel, &config);
            std::printf("  %d: %d clusters (%s)", size, clusters, e == cudaSuccess ? "ok" : cudaGetErrorString(e));
        }
        std::printf("\n");
    }
    return 0;
}
