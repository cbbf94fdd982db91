// Page geometry in C++: the rules of fms_paged/kv/geometry.py, for the kernels and operators that
// walk a page table themselves. Logical position pos of a sequence lives on its logical page
// pos / P at offset pos % P; the physical page holding it comes from the page table, and its pool
// slot is page * P + pos % P. Positions and counts are >= 0 (C++'s / and % agree with Python's
// // and % there). tests/test_native_ops.py holds these to the Python functions over a grid.
#pragma once

#include <cstdint>

namespace fms_geometry {

// logical page of position pos (geometry.py: pos // P)
inline int64_t page_of(int64_t pos, int64_t P) { return pos / P; }

// pool slot of position pos on physical page `page`, the page holding pos / P (geometry.py: slot)
inline int64_t slot(int64_t page, int64_t pos, int64_t P) { return page * P + pos % P; }

// pages that hold n tokens: ceil(n / P) (geometry.py: pages_for)
inline int64_t pages_for(int64_t n, int64_t P) { return (n + P - 1) / P; }

}  // namespace fms_geometry
