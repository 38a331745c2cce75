package apiserver

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"syscall"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/namedvol"
)

func TestStatusCodes(t *testing.T) {
	for _, c := range []struct {
		err  error
		want codes.Code
	}{
		{fmt.Errorf("%w: volume_id is empty", isolator.ErrInvalid), codes.InvalidArgument},
		{fmt.Errorf("%w: in use", isolator.ErrPrecondition), codes.FailedPrecondition},
		{fmt.Errorf("%w: Unknown CSI plugin 'x'", isolator.ErrUnknownPlugin), codes.NotFound},
		{fmt.Errorf("%w: not ready", isolator.ErrUnavailable), codes.Unavailable},
		{fmt.Errorf("writing checkpoint: %w", syscall.ENOSPC), codes.ResourceExhausted},
		{fmt.Errorf("writing checkpoint: %w", syscall.EDQUOT), codes.ResourceExhausted},
		{fmt.Errorf("waiting: %w", context.DeadlineExceeded), codes.DeadlineExceeded},
		{fmt.Errorf("waiting: %w", context.Canceled), codes.Canceled},
		{errors.New("something else"), codes.Internal},
	} {
		got := Status(c.err)
		if status.Code(got) != c.want || status.Convert(got).Message() != c.err.Error() {
			t.Errorf("Status(%q) = %v, want %v with the same message", c.err, got, c.want)
		}
	}
	if Status(nil) != nil {
		t.Error("Status(nil) is not nil")
	}
}

func TestCheckNotEngineID(t *testing.T) {
	if err := CheckNotEngineID("task-1"); err != nil {
		t.Errorf("a container id was refused: %v", err)
	}
	err := CheckNotEngineID(namedvol.EngineMountPrefix + "vol+1")
	if status.Code(Status(err)) != codes.InvalidArgument || !strings.Contains(err.Error(), "release them through the engine") {
		t.Errorf("an engine mount's id: %v, want InvalidArgument saying to use the engine", err)
	}
}
