package statuscode

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestOf(t *testing.T) {
	errA, errB := errors.New("a"), errors.New("b")
	classes := []Class{{errA, codes.InvalidArgument}, {errB, codes.NotFound}}
	for _, c := range []struct {
		err  error
		want codes.Code
	}{
		{fmt.Errorf("x: %w", errA), codes.InvalidArgument},
		{fmt.Errorf("x: %w", errB), codes.NotFound},
		{fmt.Errorf("%w and %w", errB, errA), codes.InvalidArgument}, // the first class in the table wins
		{fmt.Errorf("x: %w", context.DeadlineExceeded), codes.DeadlineExceeded},
		{fmt.Errorf("x: %w", context.Canceled), codes.Canceled},
		{errors.New("other"), codes.Internal},
	} {
		if got := Of(c.err, classes...); got != c.want {
			t.Errorf("Of(%q) = %v, want %v", c.err, got, c.want)
		}
	}
	if Error(nil) != nil {
		t.Error("Error(nil) is not nil")
	}
	if err := Error(fmt.Errorf("x: %w", errA), classes...); status.Code(err) != codes.InvalidArgument || status.Convert(err).Message() != "x: a" {
		t.Errorf("Error = %v, want InvalidArgument with the message kept", err)
	}
}
