// Scratch memory a kernel keeps from call to call, per thread: allocations made afresh per call
// (hundreds a step in a small model's decode) cost the step more than their arithmetic did.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace specserve {

// On 64-byte boundaries: where malloc put a buffer, 512-bit loads across cache lines moved a
// kernel's time by 10% from one allocation to the next.
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  bool operator==(const Aligned64&) const { return true; }
  bool operator!=(const Aligned64&) const { return false; }
};

template <typename T>
using AlignedVector = std::vector<T, Aligned64<T>>;

}  // namespace specserve
