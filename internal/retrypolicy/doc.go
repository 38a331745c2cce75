// Package retrypolicy holds the defaults and limits of the controller
// API's RetryPolicy (proto/agent/v1 controller.proto): the agent applies
// them to the fields a request leaves unset, and the CLI shows them as its
// flags' defaults. They are defined here only, so the two cannot drift.
//
// It has no code; import it for the constants alone.
package retrypolicy
