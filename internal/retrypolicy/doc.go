// Package retrypolicy holds the defaults and limits of the API's
// RetryPolicy (proto/agent/v1 controller.proto): the agent applies them to
// the fields a request leaves unset, and the CLI shows them as its flags'
// defaults. They are defined here only, so the two cannot drift.
//
// Parse turns a request's RetryPolicy into a Policy (the Controller API's
// operations and offline reclaims use it), naming the field out of its
// limits. Backoff is the one exponential backoff with a cap and jitter:
// the retries of both, the isolator's node RPC retries and the
// supervisor's plugin restarts wait what it computes (each with its own
// base, cap and jitter). Retry is the loop around it for calls retried on
// their status codes until a deadline: the isolator's plugin RPCs and the
// agent's CreateVolume and DeleteVolume.
package retrypolicy
