// RETURN_IF_ERROR / ASSIGN_OR_RETURN for absl::Status and absl::StatusOr, which Abseil 2022 lacks.
// Used by every module that crosses a boundary with a status.
#ifndef TRAINYARD_COMMON_STATUS_MACROS_H_
#define TRAINYARD_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define TY_STATUS_CONCAT_INNER(a, b) a##b
#define TY_STATUS_CONCAT(a, b) TY_STATUS_CONCAT_INNER(a, b)

// Evaluates `expr` (an absl::Status) and returns it from the enclosing function if it is not OK.
#define RETURN_IF_ERROR(expr)                \
  do {                                       \
    ::absl::Status ty_status_ = (expr);      \
    if (!ty_status_.ok()) return ty_status_; \
  } while (false)

// Evaluates `rexpr` (an absl::StatusOr<T>); on error returns its status, else moves the value into
// `lhs`, which may be a declaration (`auto x`) or an existing variable.
#define ASSIGN_OR_RETURN(lhs, rexpr) \
  TY_ASSIGN_OR_RETURN_IMPL(TY_STATUS_CONCAT(ty_statusor_, __LINE__), lhs, rexpr)

#define TY_ASSIGN_OR_RETURN_IMPL(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                             \
  if (!statusor.ok()) return statusor.status();        \
  lhs = std::move(statusor).value()

#endif  // TRAINYARD_COMMON_STATUS_MACROS_H_
