// Records the largest single heap request made while armed (the malformed-file tests use it to
// show that no allocation is sized by an unchecked count from the file).
#pragma once
#include <cstddef>

namespace alloc_tracker {
void arm();
size_t disarm();  // returns the largest request since arm()
}  // namespace alloc_tracker
