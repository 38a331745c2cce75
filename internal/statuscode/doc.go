// Package statuscode chooses the gRPC status code of an error from a
// table of error classes (sentinel errors it wraps), so that every gRPC
// edge of the project (the agent API, the plugins it ships) maps errors
// the same way: the first class that matches, a context's end as
// DeadlineExceeded or Canceled, anything else Internal, never Unknown.
//
// Not for: errors that already carry a status (the caller keeps theirs),
// or retry decisions (package retrypolicy and the specs' error tables).
package statuscode
