package loopplugin

import (
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/statuscode"
)

// Error classes. Everything inside the package wraps one of these with %w;
// toStatus, at the gRPC edge, is the only place that turns them into codes.
var (
	// ErrInvalid: the request is malformed or asks for something this
	// plugin does not support (InvalidArgument).
	ErrInvalid = errors.New("invalid argument")
	// ErrNotFound: no such volume, or the volume is not at the given path
	// (NotFound).
	ErrNotFound = errors.New("not found")
	// ErrIncompatible: the volume is already staged or published at the
	// path, or the name is taken, in a way that does not match the request
	// (AlreadyExists).
	ErrIncompatible = errors.New("already exists with different properties")
	// ErrPrecondition: the volume is not in the state the call needs:
	// published before staged, deleted while attached, reclaimed offline
	// while staged (FailedPrecondition).
	ErrPrecondition = errors.New("failed precondition")
	// ErrBusy: another operation on the same volume is in flight (Aborted).
	ErrBusy = errors.New("operation pending for volume")
	// ErrOutOfRange: the requested capacity cannot be honoured (OutOfRange).
	ErrOutOfRange = errors.New("capacity out of range")
	// ErrInvalidToken: a ListVolumes starting_token this plugin did not
	// hand out (Aborted, as CSI requires).
	ErrInvalidToken = errors.New("invalid starting token")
	// ErrNoSpace: the pool's filesystem is full (ResourceExhausted).
	ErrNoSpace = errors.New("pool out of space")
	// ErrLimit: a limit of the plugin is reached, such as the number of
	// volumes in a group (ResourceExhausted).
	ErrLimit = errors.New("limit reached")
	// ErrTopology: a CreateVolume's requisite topology excludes this node
	// (ResourceExhausted, as CSI says for unsatisfiable topology).
	ErrTopology = errors.New("topology not accessible")
	// ErrUnimplemented: the call is not available in this configuration,
	// such as replication without a replica pool (Unimplemented).
	ErrUnimplemented = errors.New("not available")
)

func invalidf(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, a...))
}

func notFoundf(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrNotFound, fmt.Sprintf(format, a...))
}

func incompatiblef(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrIncompatible, fmt.Sprintf(format, a...))
}

func preconditionf(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrPrecondition, fmt.Sprintf(format, a...))
}

// toStatus maps an error to the gRPC status the client sees. Unclassified
// errors are Internal, never Unknown; status errors pass through.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	return statuscode.Error(err, errorCodes...)
}

// errorCodes are the codes of the plugin's error classes.
var errorCodes = []statuscode.Class{
	{Err: ErrInvalid, Code: codes.InvalidArgument},
	{Err: ErrNotFound, Code: codes.NotFound},
	{Err: ErrIncompatible, Code: codes.AlreadyExists},
	{Err: ErrPrecondition, Code: codes.FailedPrecondition},
	{Err: ErrBusy, Code: codes.Aborted},
	{Err: ErrInvalidToken, Code: codes.Aborted},
	{Err: ErrOutOfRange, Code: codes.OutOfRange},
	{Err: ErrNoSpace, Code: codes.ResourceExhausted},
	{Err: ErrLimit, Code: codes.ResourceExhausted},
	{Err: ErrTopology, Code: codes.ResourceExhausted},
	{Err: ErrUnimplemented, Code: codes.Unimplemented},
}

func outOfRangef(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrOutOfRange, fmt.Sprintf(format, a...))
}

func invalidTokenf(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalidToken, fmt.Sprintf(format, a...))
}

func limitf(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrLimit, fmt.Sprintf(format, a...))
}

func unimplementedf(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrUnimplemented, fmt.Sprintf(format, a...))
}

func busyf(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrBusy, fmt.Sprintf(format, a...))
}
