// TY_CHECK: aborts on a broken invariant (never for bad input). Abseil 2022 has no absl/log.
#ifndef TRAINYARD_COMMON_CHECK_H_
#define TRAINYARD_COMMON_CHECK_H_

#include <cstdio>
#include <cstdlib>
#include <string>

#define TY_CHECK(cond, message)                                                        \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s: %s\n", __FILE__, __LINE__, #cond, \
                   std::string(message).c_str());                                      \
      std::abort();                                                                    \
    }                                                                                  \
  } while (false)

#endif  // TRAINYARD_COMMON_CHECK_H_
