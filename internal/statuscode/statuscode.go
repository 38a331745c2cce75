package statuscode

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Class is the code of the errors that wrap Err.
type Class struct {
	Err  error
	Code codes.Code
}

// Of is the code of the first class err wraps; else DeadlineExceeded or
// Canceled when err wraps a context's end; else Internal.
func Of(err error, classes ...Class) codes.Code {
	for _, c := range classes {
		if errors.Is(err, c.Err) {
			return c.Code
		}
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return codes.DeadlineExceeded
	case errors.Is(err, context.Canceled):
		return codes.Canceled
	}
	return codes.Internal
}

// Error is err as a status error with the code Of gives and err's message
// (nil for nil).
func Error(err error, classes ...Class) error {
	if err == nil {
		return nil
	}
	return status.Error(Of(err, classes...), err.Error())
}
