// cuda_stub.cpp: the cuda entry points of a host-only build (-DDFLASH_CUDA=OFF).
#include "../backend.hpp"

namespace dflash {

bool cuda_compiled() { return false; }
const char *cuda_arch_list() { return ""; }

int cuda_device_count() {
    fail(DFLASH_STATUS_NOT_SUPPORTED, "this libdflash was built without the cuda backend "
         "(DFLASH_CUDA=OFF)");
}

std::shared_ptr<Backend> make_cuda_backend(int, uint64_t, bool) {
    cuda_device_count();
    return nullptr;
}

}  // namespace dflash
