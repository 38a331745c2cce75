package controllerops

import (
	"context"
	"errors"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestAsStatusNeverUnknown(t *testing.T) {
	for _, c := range []struct {
		err  error
		want codes.Code
	}{
		{invalid("x"), codes.InvalidArgument},
		{context.DeadlineExceeded, codes.DeadlineExceeded},
		{context.Canceled, codes.Canceled},
		{errors.New("boom"), codes.Internal},
	} {
		if got := status.Code(asStatus(c.err)); got != c.want {
			t.Errorf("asStatus(%v) code %v, want %v", c.err, got, c.want)
		}
	}
}
