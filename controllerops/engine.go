package controllerops

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/csiagent/csiagent/internal/redact"
	"github.com/csiagent/csiagent/internal/retrypolicy"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// Controller operations: per-call bounds (the RetryPolicy defaults and
// limits are internal/retrypolicy's). Which codes are retried is decided per RPC by its spec's error
// table (rpcSpec.recovery): Unavailable, DeadlineExceeded and Aborted
// always; NotFound, FailedPrecondition and ResourceExhausted where the
// table says to retry with exponential backoff; never Unimplemented,
// InvalidArgument, Unauthenticated, PermissionDenied or Unknown.
const (
	// ctrlCallTimeout bounds each controller RPC; a call that runs out is
	// DeadlineExceeded, which is retried.
	ctrlCallTimeout = 2 * time.Minute
	// ctrlConnWait bounds the wait for the plugin's controller connection
	// in one attempt; running out counts as an Unavailable call.
	ctrlConnWait = 10 * time.Second
	// maxListPages guards against a plugin whose next_token never ends.
	maxListPages = 10000
)

// recovery is what the CO does when an RPC fails with one code.
type recovery struct {
	retry bool
	// hint tells the operator what to fix (or what the agent waits for).
	hint string
}

// rpcSpec is one plugin RPC and the codes its spec's error table lists;
// other codes follow generalRecovery.
type rpcSpec struct {
	service, method string
	table           map[codes.Code]recovery
	// node: the RPC is served by the plugin's node service.
	node bool
}

func (r rpcSpec) name() string { return r.service + "/" + r.method }

func (r rpcSpec) recovery(code codes.Code) recovery {
	if rec, ok := r.table[code]; ok {
		return rec
	}
	return generalRecovery(code)
}

// generalRecovery is CSI's error scheme for any RPC, plus the transport's
// transient codes.
func generalRecovery(code codes.Code) recovery {
	switch code {
	case codes.Unavailable:
		return recovery{true, "the plugin's controller is unreachable or restarting: check it with 'csi-agent plugins {plugin}'"}
	case codes.DeadlineExceeded:
		return recovery{true, fmt.Sprintf("the call did not finish within %v", ctrlCallTimeout)}
	case codes.Aborted:
		return recovery{true, "an operation is already pending in the plugin for this object; this agent sends one call at a time per object, so another client may be running one"}
	case codes.InvalidArgument:
		return recovery{false, "fix the request: a required field is missing or a value is invalid or unsupported"}
	case codes.Unimplemented:
		return recovery{false, "the plugin does not offer this call (as configured: see its message); retrying cannot help"}
	case codes.Unauthenticated:
		return recovery{false, "fix the secrets (--secrets-file) so that the plugin accepts them, then run again"}
	case codes.PermissionDenied:
		return recovery{false, "the identity in the secrets may not do this: have it granted the permission, then run again"}
	case codes.Unknown:
		return recovery{false, "study the plugin's logs before retrying"}
	case codes.Canceled:
		return recovery{false, "the call was cancelled"}
	}
	return recovery{false, "see the plugin's message and logs"}
}

// op is one operation on one plugin: its policy and progress sink.
type op struct {
	s        *Server
	plugin   string
	policy   retrypolicy.Policy
	progress func(*agentv1.Progress) error
}

// withLock runs f holding the lock of one plugin object, in this agent
// and, in a fleet, across it, reporting a WAITING progress if another
// operation holds it. f's ctx is ctx, ended in a fleet when the lock may
// be lost (FleetLocks.Lock).
func (o *op) withLock(ctx context.Context, kind, id string, f func(ctx context.Context) error) error {
	var sendErr error
	waiting := func(where string) {
		if sendErr == nil {
			sendErr = o.progress(&agentv1.Progress{
				Kind:    agentv1.Progress_WAITING,
				Message: fmt.Sprintf("another operation on %s %s of plugin %s is running %s; waiting for it", kind, cmp.Or(id, "(any)"), o.plugin, where),
			})
		}
	}
	unlock, err := o.s.locks.LockWaiting(ctx, o.plugin+"\x00"+kind+"\x00"+id, func() { waiting("through this agent") })
	if err != nil {
		return status.FromContextError(err).Err()
	}
	defer unlock()
	if sendErr != nil {
		return sendErr
	}
	if o.s.fleet != nil {
		// One object id per plugin: the lock's kind names both.
		held, unlockFleet, err := o.s.fleet.Lock(ctx, o.plugin+" "+kind, cmp.Or(id, "*"), func(holder string) {
			waiting("on node " + cmp.Or(holder, "(unknown)") + " of the fleet")
		})
		if err != nil {
			return err
		}
		defer unlockFleet()
		if sendErr != nil {
			return sendErr
		}
		err = f(held)
		if cause := context.Cause(held); err != nil && ctx.Err() == nil && held.Err() != nil && cause != held.Err() {
			// Ended because the lock may be lost, not by the caller.
			return status.Error(codes.Unavailable, cause.Error())
		}
		return err
	}
	return f(ctx)
}

// agentSide wraps an error that comes from the agent (unknown plugin, no
// controller), not from a plugin call: it is never retried.
type agentSide struct{ error }

// conn is the plugin's controller (node: node) connection for service,
// waiting a bounded time for it. Unavailable (retryable) when it is not ready in time.
func (o *op) conn(ctx context.Context, service string, node bool) (*grpc.ClientConn, error) {
	wctx, cancel := context.WithTimeout(ctx, ctrlConnWait)
	defer cancel()
	getConn := o.s.plugins.ControllerConn
	if node {
		getConn = o.s.plugins.NodeConn
	}
	conn, err := getConn(wctx, o.plugin, service)
	if err != nil && status.Code(err) != codes.Unavailable {
		return nil, agentSide{err}
	}
	return conn, err
}

// invoke makes one plugin RPC as the spec's error table says: it calls
// f until it succeeds, fails with a code not to retry, the attempts run
// out or ctx ends, waiting with exponential backoff between calls and
// reporting each retry. req is logged (secrets stripped) with each call.
func (o *op) invoke(ctx context.Context, spec rpcSpec, req proto.Message, f func(ctx context.Context, conn *grpc.ClientConn) error) error {
	log := o.s.log.With("plugin", o.plugin, "rpc", spec.name())
	for attempt := 1; ; attempt++ {
		conn, err := o.conn(ctx, spec.service, spec.node)
		if as := (agentSide{}); errors.As(err, &as) {
			return asStatus(as.error)
		}
		if err == nil {
			log.Debug("controller call", "attempt", attempt, "request", redact.Value(req))
			cctx, cancel := context.WithTimeout(ctx, ctrlCallTimeout)
			err = f(cctx, conn)
			cancel()
		}
		if err == nil {
			log.Debug("controller call succeeded", "attempt", attempt)
			return nil
		}
		st := status.Convert(err)
		log.Debug("controller call failed", "attempt", attempt, "code", st.Code(), "error", st.Message())
		if ctx.Err() != nil {
			return o.gaveUp(ctx, spec, attempt, st)
		}
		rec := spec.recovery(st.Code())
		if !rec.retry {
			return o.failed(spec, st, rec, fmt.Sprintf("%s, not retried", calls(attempt)))
		}
		if attempt >= o.policy.Attempts {
			return o.failed(spec, st, rec, fmt.Sprintf("gave up after %s", calls(attempt)))
		}
		wait := o.policy.Backoff(attempt)
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < wait {
			return o.failed(spec, st, rec, fmt.Sprintf("gave up after %s: the operation's timeout ends before the next retry", calls(attempt)))
		}
		if err := o.progress(&agentv1.Progress{
			Kind: agentv1.Progress_RETRY, Rpc: spec.name(), Attempt: uint32(attempt), MaxAttempts: uint32(o.policy.Attempts),
			Code: st.Code().String(), Message: st.Message(), Hint: o.hint(spec, st.Code(), rec), RetryIn: durationpb.New(wait),
		}); err != nil {
			return err
		}
		if err := sleep(ctx, wait); err != nil {
			return o.gaveUp(ctx, spec, attempt, st)
		}
	}
}

func calls(n int) string {
	if n == 1 {
		return "1 call"
	}
	return fmt.Sprintf("%d calls", n)
}

// sleep waits d or until ctx ends.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// hint is rec's hint with what the agent knows of the plugin.
func (o *op) hint(spec rpcSpec, code codes.Code, rec recovery) string {
	h := strings.ReplaceAll(rec.hint, "{plugin}", o.plugin)
	switch code {
	case codes.Unimplemented:
		if !o.s.plugins.Offers(o.plugin, spec.service) {
			h += fmt.Sprintf(" (plugin %s did not offer %s when the agent discovered it)", o.plugin, spec.service)
		}
	case codes.Unknown:
		if dir := o.s.plugins.LogDir(o.plugin); dir != "" {
			h += " (" + dir + ")"
		}
	}
	return h
}

// failed is the status an operation ends with when a plugin call fails
// for good: the plugin's code, and a message with the RPC, the plugin's
// message, the attempts and what to fix.
func (o *op) failed(spec rpcSpec, st *status.Status, rec recovery, attempts string) error {
	return status.Errorf(st.Code(), "plugin %s: %s: %s (%s). %s", o.plugin, spec.name(), st.Message(), attempts, capitalize(o.hint(spec, st.Code(), rec)))
}

// gaveUp is the status when ctx ended: Canceled if the caller went away,
// DeadlineExceeded when the policy's timeout ran out.
func (o *op) gaveUp(ctx context.Context, spec rpcSpec, attempt int, last *status.Status) error {
	if errors.Is(ctx.Err(), context.Canceled) {
		return status.Errorf(codes.Canceled, "plugin %s: %s: cancelled after %s", o.plugin, spec.name(), calls(attempt))
	}
	return status.Errorf(codes.DeadlineExceeded, "plugin %s: %s: the operation's timeout (%v) ran out after %s; last error: %s: %s",
		o.plugin, spec.name(), o.policy.Timeout, calls(attempt), last.Code(), last.Message())
}

func capitalize(s string) string {
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}

// untilReady calls call until it reports ready (or once with noWait),
// with exponential backoff between calls, as the specs say a CO keeps
// calling ResyncVolume and CreateVolumeGroupSnapshot until ready.
func (o *op) untilReady(ctx context.Context, spec rpcSpec, noWait bool, what string, call func(ctx context.Context) (bool, error)) (bool, error) {
	for n := 1; ; n++ {
		ready, err := call(ctx)
		if err != nil || ready || noWait {
			return ready, err
		}
		wait := o.policy.Backoff(n)
		notReady := func() error {
			return status.Errorf(codes.DeadlineExceeded, "plugin %s: %s: %s not ready after %s within the operation's timeout (%v); the plugin goes on: run the command again to check",
				o.plugin, spec.name(), what, calls(n), o.policy.Timeout)
		}
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < wait {
			return false, notReady()
		}
		if err := o.progress(&agentv1.Progress{
			Kind: agentv1.Progress_NOT_READY, Rpc: spec.name(), Attempt: uint32(n),
			Message: what + " is not ready yet", RetryIn: durationpb.New(wait),
		}); err != nil {
			return false, err
		}
		if err := sleep(ctx, wait); err != nil {
			if errors.Is(err, context.Canceled) {
				return false, status.FromContextError(err).Err()
			}
			return false, notReady()
		}
	}
}

// noEmpty rejects empty ids in a list.
func noEmpty(field string, ids []string) error {
	if slices.Contains(ids, "") {
		return invalid("%s has an empty id", field)
	}
	return nil
}

// callPlugin calls one plugin RPC through o.invoke (the connection, the
// retries and the error table spec): method, on the client newClient
// makes of the connection, with req. It returns the plugin's reply.
func callPlugin[C any, Req proto.Message, Resp any](ctx context.Context, o *op, spec rpcSpec, newClient func(grpc.ClientConnInterface) C,
	method func(C, context.Context, Req, ...grpc.CallOption) (Resp, error), req Req) (Resp, error) {
	var resp Resp
	err := o.invoke(ctx, spec, req, func(ctx context.Context, conn *grpc.ClientConn) (err error) {
		resp, err = method(newClient(conn), ctx, req)
		return err
	})
	return resp, err
}
