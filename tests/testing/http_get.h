// A minimal blocking HTTP/1.0 GET for tests that scrape /metrics endpoints on loopback.
#ifndef TRAINYARD_TESTS_TESTING_HTTP_GET_H_
#define TRAINYARD_TESTS_TESTING_HTTP_GET_H_

#include <string>

#include "absl/status/statusor.h"

namespace trainyard::testing {

// The body of GET http://HOST:PORT/PATH; UNAVAILABLE if it cannot connect, INTERNAL on a status
// other than 200.
absl::StatusOr<std::string> HttpGet(const std::string& host_port, const std::string& path);

}  // namespace trainyard::testing

#endif  // TRAINYARD_TESTS_TESTING_HTTP_GET_H_
