package agent

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/csiagent/csiagent/internal/redact"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/proto/replication"
	"github.com/csiagent/csiagent/proto/volumegroup"
)

// Controller operations: RetryPolicy defaults and limits, and per-call
// bounds. Which codes are retried is decided per RPC by its spec's error
// table (rpcSpec.recovery): Unavailable, DeadlineExceeded and Aborted
// always; NotFound, FailedPrecondition and ResourceExhausted where the
// table says to retry with exponential backoff; never Unimplemented,
// InvalidArgument, Unauthenticated, PermissionDenied or Unknown.
const (
	defaultCtrlAttempts   = 5
	maxCtrlAttempts       = 100
	defaultCtrlBackoff    = 500 * time.Millisecond
	minCtrlBackoff        = 10 * time.Millisecond
	defaultCtrlMaxBackoff = 30 * time.Second
	defaultCtrlTimeout    = 10 * time.Minute
	maxCtrlTimeout        = 24 * time.Hour
	// ctrlCallTimeout bounds each controller RPC; a call that runs out is
	// DeadlineExceeded, which is retried.
	ctrlCallTimeout = 2 * time.Minute
	// ctrlConnWait bounds the wait for the plugin's controller connection
	// in one attempt; running out counts as an Unavailable call.
	ctrlConnWait = 10 * time.Second
	// maxListPages guards against a plugin whose next_token never ends.
	maxListPages = 10000
)

// The csi-addons and CSI services the controller operations call, as
// discovery names them (pluginOffers).
const (
	volumeGroupService     = "volumegroup.Controller"
	replicationService     = "replication.Controller"
	groupControllerService = "csi.v1.GroupController"
)

// controllerServer is the Controller API service: the agent as the CO of
// the csi-addons VolumeGroup and Replication specs and of CSI's
// GroupController. Its zero value (besides a) is ready to use.
type controllerServer struct {
	agentv1.UnimplementedControllerServer
	a *Agent
	// locks keeps one operation in flight per plugin object, as the specs
	// ask of a CO.
	locks keyedLocks
}

var _ agentv1.ControllerServer = (*controllerServer)(nil)

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
		return recovery{false, "the plugin does not implement this call; retrying cannot help"}
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

func volumeGroupSpec(method string, table map[codes.Code]recovery) rpcSpec {
	return rpcSpec{service: volumeGroupService, method: method, table: table}
}

// The volumegroup.Controller error tables (seed 000). Tables are built per
// call, so no mutable package state holds them.

func createVolumeGroupSpec() rpcSpec {
	return volumeGroupSpec("CreateVolumeGroup", map[codes.Code]recovery{
		codes.InvalidArgument: {false, "the plugin cannot make a volume group with these parameters: use different parameters"},
		codes.AlreadyExists:   {false, "a volume group with this name exists but is incompatible with these parameters: fix the arguments or use a different name"},
	})
}

func deleteVolumeGroupSpec() rpcSpec {
	return volumeGroupSpec("DeleteVolumeGroup", map[codes.Code]recovery{
		codes.FailedPrecondition: {true, "the volume group is in use or has snapshots: make sure nothing uses it and delete its snapshots (the agent retries meanwhile)"},
	})
}

func modifyVolumeGroupSpec() rpcSpec {
	return volumeGroupSpec("ModifyVolumeGroupMembership", map[codes.Code]recovery{
		codes.InvalidArgument:   {false, "a volume is incompatible with the others in the group or not supported: use different volume ids"},
		codes.NotFound:          {true, "a volume id or the volume group does not exist: verify the volume ids and that the group exists ('csi-agent group get')"},
		codes.ResourceExhausted: {true, "the volume group cannot take more volumes: remove volumes or raise the plugin's limit"},
	})
}

func getVolumeGroupSpec() rpcSpec {
	return volumeGroupSpec("ControllerGetVolumeGroup", map[codes.Code]recovery{
		codes.NotFound: {true, "no such volume group: verify the id ('csi-agent group list') and that the group has not been deleted"},
	})
}

// listVolumeGroupsSpec: with a starting token, Aborted means the token is
// invalid, which the caller handles by restarting (not by retrying).
func listVolumeGroupsSpec(withToken bool) rpcSpec {
	table := map[codes.Code]recovery{}
	if withToken {
		table[codes.Aborted] = recovery{false, "the plugin rejected the starting token: list again from the beginning"}
	}
	return volumeGroupSpec("ListVolumeGroups", table)
}

// replicationSpec is a replication.Controller RPC's error table (seed
// 003); failedPrecondition is its FAILED_PRECONDITION row, if any.
func replicationSpec(method, failedPrecondition string) rpcSpec {
	table := map[codes.Code]recovery{
		codes.InvalidArgument: {false, "a required field is missing or invalid: fix the request"},
		codes.NotFound:        {true, "the volume (or volume group) does not exist: verify the id and that it has not been deleted"},
	}
	if failedPrecondition != "" {
		table[codes.FailedPrecondition] = recovery{false, failedPrecondition}
	}
	return rpcSpec{service: replicationService, method: method, table: table}
}

func groupControllerSpec(method string, table map[codes.Code]recovery) rpcSpec {
	return rpcSpec{service: groupControllerService, method: method, table: table}
}

const snapshotIDsMismatch = "the snapshot ids do not match the group snapshot: pass the ids that 'csi-agent group-snapshot create' printed"

func createGroupSnapshotSpec() rpcSpec {
	return groupControllerSpec("CreateVolumeGroupSnapshot", map[codes.Code]recovery{
		codes.AlreadyExists:      {false, "a group snapshot with this name exists for other volumes or parameters: fix the arguments or use a different name"},
		codes.FailedPrecondition: {false, "these volumes cannot be snapshotted together: fix their configuration to meet the plugin's requirements for group snapshots"},
		codes.ResourceExhausted:  {false, "not enough space for the group snapshot: free space, then run again"},
	})
}

func deleteGroupSnapshotSpec() rpcSpec {
	return groupControllerSpec("DeleteVolumeGroupSnapshot", map[codes.Code]recovery{
		codes.InvalidArgument:    {false, snapshotIDsMismatch},
		codes.FailedPrecondition: {true, "the group snapshot is in use: make sure nothing uses it (the agent retries meanwhile)"},
	})
}

func getGroupSnapshotSpec() rpcSpec {
	return groupControllerSpec("GetVolumeGroupSnapshot", map[codes.Code]recovery{
		codes.InvalidArgument: {false, snapshotIDsMismatch},
		codes.NotFound:        {true, "no such group snapshot: verify the id and that it has not been deleted"},
	})
}

// retryPolicy is a validated agentv1.RetryPolicy.
type retryPolicy struct {
	attempts              int
	initial, max, timeout time.Duration
}

func parseRetryPolicy(p *agentv1.RetryPolicy) (retryPolicy, error) {
	rp := retryPolicy{attempts: defaultCtrlAttempts, initial: defaultCtrlBackoff, max: defaultCtrlMaxBackoff, timeout: defaultCtrlTimeout}
	if p == nil {
		return rp, nil
	}
	if n := p.GetMaxAttempts(); n > 0 {
		if n > maxCtrlAttempts {
			return rp, fmt.Errorf("retry.max_attempts %d: at most %d", n, maxCtrlAttempts)
		}
		rp.attempts = int(n)
	}
	dur := func(name string, d *durationpb.Duration, lo, hi time.Duration, into *time.Duration) error {
		if d == nil {
			return nil
		}
		if err := d.CheckValid(); err != nil {
			return fmt.Errorf("retry.%s: %w", name, err)
		}
		v := d.AsDuration()
		if v == 0 {
			return nil
		}
		if v < lo || v > hi {
			return fmt.Errorf("retry.%s %v: must be between %v and %v", name, v, lo, hi)
		}
		*into = v
		return nil
	}
	if err := dur("initial_backoff", p.GetInitialBackoff(), minCtrlBackoff, maxCtrlTimeout, &rp.initial); err != nil {
		return rp, err
	}
	if err := dur("max_backoff", p.GetMaxBackoff(), minCtrlBackoff, maxCtrlTimeout, &rp.max); err != nil {
		return rp, err
	}
	if err := dur("timeout", p.GetTimeout(), time.Millisecond, maxCtrlTimeout, &rp.timeout); err != nil {
		return rp, err
	}
	rp.max = max(rp.max, rp.initial)
	return rp, nil
}

// backoff is the wait after the n-th failed call (from 1): initial
// doubling up to max, with up to 10% jitter so that agents retrying the
// same plugin spread out.
func (p retryPolicy) backoff(n int) time.Duration {
	d := p.initial << min(n-1, 30)
	if d > p.max || d <= 0 {
		d = p.max
	}
	return d + rand.N(d/10+1)
}

// keyedLocks serialises operations per key. The zero value is ready.
type keyedLocks struct {
	mu   sync.Mutex
	held map[string]chan struct{}
}

// lock takes key's lock, calling waiting once first if another holder
// has it. A waiter whose ctx ends gets ctx.Err().
func (k *keyedLocks) lock(ctx context.Context, key string, waiting func()) (unlock func(), err error) {
	for {
		k.mu.Lock()
		if k.held == nil {
			k.held = map[string]chan struct{}{}
		}
		busy, ok := k.held[key]
		if !ok {
			done := make(chan struct{})
			k.held[key] = done
			k.mu.Unlock()
			return func() {
				k.mu.Lock()
				delete(k.held, key)
				k.mu.Unlock()
				close(done)
			}, nil
		}
		k.mu.Unlock()
		if waiting != nil {
			waiting()
			waiting = nil
		}
		select {
		case <-busy:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// ctrlOp is one operation on one plugin: its policy, progress sink and
// logger.
type ctrlOp struct {
	s        *controllerServer
	plugin   string
	method   string
	policy   retryPolicy
	progress func(*agentv1.Progress) error
}

// begin validates what every operation needs, logs the request (secrets
// stripped) and returns the operation with a context bounded by the
// policy's timeout.
func (s *controllerServer) begin(ctx context.Context, method, plugin string, policy *agentv1.RetryPolicy, req proto.Message,
	progress func(*agentv1.Progress) error) (*ctrlOp, context.Context, context.CancelFunc, error) {
	if plugin == "" {
		return nil, nil, nil, status.Error(codes.InvalidArgument, "plugin_name is required: the plugin's type, as 'csi-agent plugins' lists it")
	}
	rp, err := parseRetryPolicy(policy)
	if err != nil {
		return nil, nil, nil, status.Error(codes.InvalidArgument, err.Error())
	}
	s.a.log.Info("controller operation", "method", method, "plugin", plugin, "request", redact.Value(req))
	ctx, cancel := context.WithTimeout(ctx, rp.timeout)
	return &ctrlOp{s: s, plugin: plugin, method: method, policy: rp, progress: progress}, ctx, cancel, nil
}

// finish logs how an operation ended and makes sure a status error leaves
// the API (never Unknown for an agent-side error).
func (o *ctrlOp) finish(err error) error {
	log := o.s.a.log.With("method", o.method, "plugin", o.plugin)
	if err == nil {
		log.Info("controller operation done")
		return nil
	}
	err = asStatus(err)
	log.Warn("controller operation failed", "code", status.Code(err), "error", status.Convert(err).Message())
	return err
}

// asStatus keeps status errors and maps others as toStatus does.
func asStatus(err error) error {
	if _, ok := status.FromError(err); ok {
		return err
	}
	return toStatus(err)
}

// withLock runs f holding the lock of one plugin object, reporting a
// WAITING progress if another operation holds it.
func (o *ctrlOp) withLock(ctx context.Context, kind, id string, f func() error) error {
	var sendErr error
	unlock, err := o.s.locks.lock(ctx, o.plugin+"\x00"+kind+"\x00"+id, func() {
		sendErr = o.progress(&agentv1.Progress{
			Kind:    agentv1.Progress_WAITING,
			Message: fmt.Sprintf("another operation on %s %s of plugin %s is running through this agent; waiting for it", kind, id, o.plugin),
		})
	})
	if sendErr != nil {
		if unlock != nil {
			unlock()
		}
		return sendErr
	}
	if err != nil {
		return status.FromContextError(err).Err()
	}
	defer unlock()
	return f()
}

// agentSide wraps an error that comes from the agent (unknown plugin, no
// controller), not from a plugin call: it is never retried.
type agentSide struct{ error }

// conn is the plugin's controller connection, waiting a bounded time for
// it. Unavailable (retryable) when it is not ready in time.
func (o *ctrlOp) conn(ctx context.Context) (*grpc.ClientConn, error) {
	wctx, cancel := context.WithTimeout(ctx, ctrlConnWait)
	defer cancel()
	conn, err := o.s.a.controllerConn(wctx, o.plugin)
	if err != nil && status.Code(err) != codes.Unavailable {
		return nil, agentSide{err}
	}
	return conn, err
}

// invoke makes one plugin RPC as the spec's error table says: it calls
// f until it succeeds, fails with a code not to retry, the attempts run
// out or ctx ends, waiting with exponential backoff between calls and
// reporting each retry. req is logged (secrets stripped) with each call.
func (o *ctrlOp) invoke(ctx context.Context, spec rpcSpec, req proto.Message, f func(ctx context.Context, conn *grpc.ClientConn) error) error {
	log := o.s.a.log.With("plugin", o.plugin, "rpc", spec.name())
	for attempt := 1; ; attempt++ {
		conn, err := o.conn(ctx)
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
		if attempt >= o.policy.attempts {
			return o.failed(spec, st, rec, fmt.Sprintf("gave up after %s", calls(attempt)))
		}
		wait := o.policy.backoff(attempt)
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < wait {
			return o.failed(spec, st, rec, fmt.Sprintf("gave up after %s: the operation's timeout ends before the next retry", calls(attempt)))
		}
		if err := o.progress(&agentv1.Progress{
			Kind: agentv1.Progress_RETRY, Rpc: spec.name(), Attempt: uint32(attempt), MaxAttempts: uint32(o.policy.attempts),
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
func (o *ctrlOp) hint(spec rpcSpec, code codes.Code, rec recovery) string {
	h := strings.ReplaceAll(rec.hint, "{plugin}", o.plugin)
	switch code {
	case codes.Unimplemented:
		if !o.s.a.pluginOffers(o.plugin, spec.service) {
			h += fmt.Sprintf(" (plugin %s did not offer %s when the agent discovered it)", o.plugin, spec.service)
		}
	case codes.Unknown:
		if dir := o.s.a.pluginLogDir(o.plugin); dir != "" {
			h += " (" + dir + ")"
		}
	}
	return h
}

// failed is the status an operation ends with when a plugin call fails
// for good: the plugin's code, and a message with the RPC, the plugin's
// message, the attempts and what to fix.
func (o *ctrlOp) failed(spec rpcSpec, st *status.Status, rec recovery, attempts string) error {
	return status.Errorf(st.Code(), "plugin %s: %s: %s (%s). %s", o.plugin, spec.name(), st.Message(), attempts, capitalize(o.hint(spec, st.Code(), rec)))
}

// gaveUp is the status when ctx ended: Canceled if the caller went away,
// DeadlineExceeded when the policy's timeout ran out.
func (o *ctrlOp) gaveUp(ctx context.Context, spec rpcSpec, attempt int, last *status.Status) error {
	if errors.Is(ctx.Err(), context.Canceled) {
		return status.Errorf(codes.Canceled, "plugin %s: %s: cancelled after %s", o.plugin, spec.name(), calls(attempt))
	}
	return status.Errorf(codes.DeadlineExceeded, "plugin %s: %s: the operation's timeout (%v) ran out after %s; last error: %s: %s",
		o.plugin, spec.name(), o.policy.timeout, calls(attempt), last.Code(), last.Message())
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
func (o *ctrlOp) untilReady(ctx context.Context, spec rpcSpec, noWait bool, what string, call func(ctx context.Context) (bool, error)) (bool, error) {
	for n := 1; ; n++ {
		ready, err := call(ctx)
		if err != nil || ready || noWait {
			return ready, err
		}
		wait := o.policy.backoff(n)
		notReady := func() error {
			return status.Errorf(codes.DeadlineExceeded, "plugin %s: %s: %s not ready after %s within the operation's timeout (%v); the plugin goes on: run the command again to check",
				o.plugin, spec.name(), what, calls(n), o.policy.timeout)
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

// pluginLogDir is where a managed plugin's logs are ("" for unmanaged
// plugins, whose logs the agent does not keep).
func (a *Agent) pluginLogDir(typ string) string {
	a.mu.Lock()
	r := a.plugins[typ]
	a.mu.Unlock()
	if r == nil || !r.plugin.Info.Managed() {
		return ""
	}
	return r.logDir()
}

func invalid(format string, args ...any) error {
	return status.Errorf(codes.InvalidArgument, format, args...)
}

// Volume groups.

func (s *controllerServer) CreateVolumeGroup(req *agentv1.CreateVolumeGroupRequest, stream grpc.ServerStreamingServer[agentv1.VolumeGroupReply]) error {
	progress := func(p *agentv1.Progress) error { return stream.Send(&agentv1.VolumeGroupReply{Progress: p}) }
	o, ctx, cancel, err := s.begin(stream.Context(), "CreateVolumeGroup", req.GetPluginName(), req.GetRetry(), req, progress)
	if err != nil {
		return err
	}
	defer cancel()
	return o.finish(func() error {
		if req.GetName() == "" {
			return invalid("name is required: it makes the create idempotent")
		}
		if err := noEmpty("volume_ids", req.GetVolumeIds()); err != nil {
			return err
		}
		return o.withLock(ctx, "volume group name", req.GetName(), func() error {
			preq := &volumegroup.CreateVolumeGroupRequest{Name: req.GetName(), Parameters: req.GetParameters(), Secrets: req.GetSecrets(), VolumeIds: req.GetVolumeIds()}
			var resp *volumegroup.CreateVolumeGroupResponse
			if err := o.invoke(ctx, createVolumeGroupSpec(), preq, func(ctx context.Context, conn *grpc.ClientConn) (err error) {
				resp, err = volumegroup.NewControllerClient(conn).CreateVolumeGroup(ctx, preq)
				return err
			}); err != nil {
				return err
			}
			return stream.Send(&agentv1.VolumeGroupReply{VolumeGroup: resp.GetVolumeGroup()})
		})
	}())
}

func (s *controllerServer) ModifyVolumeGroup(req *agentv1.ModifyVolumeGroupRequest, stream grpc.ServerStreamingServer[agentv1.VolumeGroupReply]) error {
	progress := func(p *agentv1.Progress) error { return stream.Send(&agentv1.VolumeGroupReply{Progress: p}) }
	o, ctx, cancel, err := s.begin(stream.Context(), "ModifyVolumeGroup", req.GetPluginName(), req.GetRetry(), req, progress)
	if err != nil {
		return err
	}
	defer cancel()
	return o.finish(func() error {
		if req.GetVolumeGroupId() == "" {
			return invalid("volume_group_id is required")
		}
		if err := noEmpty("volume_ids", req.GetVolumeIds()); err != nil {
			return err
		}
		switch {
		case len(req.GetVolumeIds()) == 0 && !req.GetRemoveAll():
			return invalid("volume_ids is empty, which removes every volume from the group: set remove_all to mean it")
		case len(req.GetVolumeIds()) > 0 && req.GetRemoveAll():
			return invalid("remove_all is set but volume_ids is not empty: choose one")
		}
		return o.withLock(ctx, "volume group", req.GetVolumeGroupId(), func() error {
			preq := &volumegroup.ModifyVolumeGroupMembershipRequest{
				VolumeGroupId: req.GetVolumeGroupId(), VolumeIds: req.GetVolumeIds(), Parameters: req.GetParameters(), Secrets: req.GetSecrets(),
			}
			var resp *volumegroup.ModifyVolumeGroupMembershipResponse
			if err := o.invoke(ctx, modifyVolumeGroupSpec(), preq, func(ctx context.Context, conn *grpc.ClientConn) (err error) {
				resp, err = volumegroup.NewControllerClient(conn).ModifyVolumeGroupMembership(ctx, preq)
				return err
			}); err != nil {
				return err
			}
			return stream.Send(&agentv1.VolumeGroupReply{VolumeGroup: resp.GetVolumeGroup()})
		})
	}())
}

func (s *controllerServer) DeleteVolumeGroup(req *agentv1.DeleteVolumeGroupRequest, stream grpc.ServerStreamingServer[agentv1.OperationReply]) error {
	progress := func(p *agentv1.Progress) error { return stream.Send(&agentv1.OperationReply{Progress: p}) }
	o, ctx, cancel, err := s.begin(stream.Context(), "DeleteVolumeGroup", req.GetPluginName(), req.GetRetry(), req, progress)
	if err != nil {
		return err
	}
	defer cancel()
	return o.finish(func() error {
		if req.GetVolumeGroupId() == "" {
			return invalid("volume_group_id is required")
		}
		return o.withLock(ctx, "volume group", req.GetVolumeGroupId(), func() error {
			preq := &volumegroup.DeleteVolumeGroupRequest{VolumeGroupId: req.GetVolumeGroupId(), Secrets: req.GetSecrets()}
			if err := o.invoke(ctx, deleteVolumeGroupSpec(), preq, func(ctx context.Context, conn *grpc.ClientConn) error {
				_, err := volumegroup.NewControllerClient(conn).DeleteVolumeGroup(ctx, preq)
				return err
			}); err != nil {
				return err
			}
			return stream.Send(&agentv1.OperationReply{Done: true})
		})
	}())
}

func (s *controllerServer) GetVolumeGroup(req *agentv1.GetVolumeGroupRequest, stream grpc.ServerStreamingServer[agentv1.VolumeGroupReply]) error {
	progress := func(p *agentv1.Progress) error { return stream.Send(&agentv1.VolumeGroupReply{Progress: p}) }
	o, ctx, cancel, err := s.begin(stream.Context(), "GetVolumeGroup", req.GetPluginName(), req.GetRetry(), req, progress)
	if err != nil {
		return err
	}
	defer cancel()
	return o.finish(func() error {
		if req.GetVolumeGroupId() == "" {
			return invalid("volume_group_id is required")
		}
		preq := &volumegroup.ControllerGetVolumeGroupRequest{VolumeGroupId: req.GetVolumeGroupId(), Secrets: req.GetSecrets()}
		var resp *volumegroup.ControllerGetVolumeGroupResponse
		if err := o.invoke(ctx, getVolumeGroupSpec(), preq, func(ctx context.Context, conn *grpc.ClientConn) (err error) {
			resp, err = volumegroup.NewControllerClient(conn).ControllerGetVolumeGroup(ctx, preq)
			return err
		}); err != nil {
			return err
		}
		return stream.Send(&agentv1.VolumeGroupReply{VolumeGroup: resp.GetVolumeGroup()})
	}())
}

func (s *controllerServer) ListVolumeGroups(req *agentv1.ListVolumeGroupsRequest, stream grpc.ServerStreamingServer[agentv1.ListVolumeGroupsReply]) error {
	progress := func(p *agentv1.Progress) error { return stream.Send(&agentv1.ListVolumeGroupsReply{Progress: p}) }
	o, ctx, cancel, err := s.begin(stream.Context(), "ListVolumeGroups", req.GetPluginName(), req.GetRetry(), req, progress)
	if err != nil {
		return err
	}
	defer cancel()
	return o.finish(func() error {
		if req.GetMaxEntries() < 0 {
			return invalid("max_entries %d: must not be negative", req.GetMaxEntries())
		}
		reply, err := o.listVolumeGroups(ctx, req)
		if err != nil {
			return err
		}
		return stream.Send(reply)
	}())
}

// listVolumeGroups pages through ListVolumeGroups. An Aborted answer to a
// call with a starting token means the token is invalid: listing starts
// again from the beginning, once (the spec's recovery); the next one
// fails.
func (o *ctrlOp) listVolumeGroups(ctx context.Context, req *agentv1.ListVolumeGroupsRequest) (*agentv1.ListVolumeGroupsReply, error) {
	reply := &agentv1.ListVolumeGroupsReply{}
	token := req.GetStartingToken()
	seen := map[string]bool{}
	used := map[string]bool{}
	for page := 1; ; page++ {
		if page > maxListPages {
			return nil, status.Errorf(codes.Internal, "plugin %s: ListVolumeGroups: more than %d pages; the plugin's next_token never ends", o.plugin, maxListPages)
		}
		preq := &volumegroup.ListVolumeGroupsRequest{MaxEntries: req.GetMaxEntries(), StartingToken: token, Secrets: req.GetSecrets()}
		spec := listVolumeGroupsSpec(token != "")
		var resp *volumegroup.ListVolumeGroupsResponse
		err := o.invoke(ctx, spec, preq, func(ctx context.Context, conn *grpc.ClientConn) (err error) {
			resp, err = volumegroup.NewControllerClient(conn).ListVolumeGroups(ctx, preq)
			return err
		})
		if token != "" && status.Code(err) == codes.Aborted {
			if reply.Restarted {
				return nil, status.Errorf(codes.Aborted, "%s; the listing was already restarted from the beginning once, so it is not restarted again: run it again later", status.Convert(err).Message())
			}
			if err := o.progress(&agentv1.Progress{
				Kind: agentv1.Progress_RESTART, Rpc: spec.name(), Code: codes.Aborted.String(), Message: status.Convert(err).Message(),
				Hint: "the starting token is not valid: listing again from the beginning; drop the entries received so far",
			}); err != nil {
				return nil, err
			}
			reply = &agentv1.ListVolumeGroupsReply{Restarted: true}
			token, seen, used = "", map[string]bool{}, map[string]bool{}
			continue
		}
		if err != nil {
			return nil, err
		}
		for _, e := range resp.GetEntries() {
			g := e.GetVolumeGroup()
			if g == nil || seen[g.GetVolumeGroupId()] {
				continue
			}
			seen[g.GetVolumeGroupId()] = true
			reply.VolumeGroups = append(reply.VolumeGroups, g)
		}
		next := resp.GetNextToken()
		if !req.GetAllPages() || next == "" {
			if req.GetAllPages() {
				next = ""
			}
			reply.NextToken = next
			return reply, nil
		}
		if used[next] || next == token {
			return nil, status.Errorf(codes.Internal, "plugin %s: ListVolumeGroups returned next_token %q again; stopping to avoid a loop", o.plugin, next)
		}
		used[next] = true
		token = next
	}
}

// noEmpty rejects empty ids in a list.
func noEmpty(field string, ids []string) error {
	if slices.Contains(ids, "") {
		return invalid("%s has an empty id", field)
	}
	return nil
}

// Replication.

// replicationOp is what differs between the replication operations.
type replicationOp struct {
	method             string // the API method
	rpc                string // the plugin RPC
	failedPrecondition string // the FAILED_PRECONDITION row's recovery
	force, wait, info  bool   // takes force; polls until ready; returns info
}

func (s *controllerServer) EnableReplication(req *agentv1.ReplicationRequest, stream grpc.ServerStreamingServer[agentv1.ReplicationReply]) error {
	return s.replicate(req, stream, replicationOp{method: "EnableReplication", rpc: "EnableVolumeReplication"})
}

func (s *controllerServer) DisableReplication(req *agentv1.ReplicationRequest, stream grpc.ServerStreamingServer[agentv1.ReplicationReply]) error {
	return s.replicate(req, stream, replicationOp{method: "DisableReplication", rpc: "DisableVolumeReplication"})
}

func (s *controllerServer) PromoteVolume(req *agentv1.ReplicationRequest, stream grpc.ServerStreamingServer[agentv1.ReplicationReply]) error {
	return s.replicate(req, stream, replicationOp{method: "PromoteVolume", rpc: "PromoteVolume", force: true,
		failedPrecondition: "the volume cannot be promoted: make sure replication is enabled ('csi-agent replication enable'); a volume that can only be promoted by force needs --force"})
}

func (s *controllerServer) DemoteVolume(req *agentv1.ReplicationRequest, stream grpc.ServerStreamingServer[agentv1.ReplicationReply]) error {
	return s.replicate(req, stream, replicationOp{method: "DemoteVolume", rpc: "DemoteVolume", force: true,
		failedPrecondition: "the volume cannot be demoted: make sure replication is enabled ('csi-agent replication enable')"})
}

func (s *controllerServer) ResyncVolume(req *agentv1.ReplicationRequest, stream grpc.ServerStreamingServer[agentv1.ReplicationReply]) error {
	return s.replicate(req, stream, replicationOp{method: "ResyncVolume", rpc: "ResyncVolume", force: true, wait: true,
		failedPrecondition: "the volume cannot be resynced: make sure replication is enabled and the volume is demoted ('csi-agent replication demote')"})
}

func (s *controllerServer) GetReplicationInfo(req *agentv1.ReplicationRequest, stream grpc.ServerStreamingServer[agentv1.ReplicationReply]) error {
	return s.replicate(req, stream, replicationOp{method: "GetReplicationInfo", rpc: "GetVolumeReplicationInfo", info: true,
		failedPrecondition: "no replication info: make sure replication is enabled and the volume is promoted (primary)"})
}

// replicate runs one replication operation on a volume or volume group.
func (s *controllerServer) replicate(req *agentv1.ReplicationRequest, stream grpc.ServerStreamingServer[agentv1.ReplicationReply], op replicationOp) error {
	progress := func(p *agentv1.Progress) error { return stream.Send(&agentv1.ReplicationReply{Progress: p}) }
	o, ctx, cancel, err := s.begin(stream.Context(), op.method, req.GetPluginName(), req.GetRetry(), req, progress)
	if err != nil {
		return err
	}
	defer cancel()
	return o.finish(func() error {
		var (
			src      *replication.ReplicationSource
			volumeID string
			kind, id string
		)
		switch v := req.GetSource().(type) {
		case *agentv1.ReplicationRequest_VolumeId:
			if v.VolumeId == "" {
				return invalid("volume_id is empty")
			}
			volumeID, kind, id = v.VolumeId, "volume", v.VolumeId
			src = &replication.ReplicationSource{Type: &replication.ReplicationSource_Volume{Volume: &replication.ReplicationSource_VolumeSource{VolumeId: v.VolumeId}}}
		case *agentv1.ReplicationRequest_VolumeGroupId:
			if v.VolumeGroupId == "" {
				return invalid("volume_group_id is empty")
			}
			kind, id = "volume group", v.VolumeGroupId
			src = &replication.ReplicationSource{Type: &replication.ReplicationSource_Volumegroup{Volumegroup: &replication.ReplicationSource_VolumeGroupSource{VolumeGroupId: v.VolumeGroupId}}}
		default:
			return invalid("name the volume_id or the volume_group_id to replicate")
		}
		switch {
		case req.GetForce() && !op.force:
			return invalid("force applies to PromoteVolume, DemoteVolume and ResyncVolume only, not %s", op.rpc)
		case req.GetNoWait() && !op.wait:
			return invalid("no_wait applies to ResyncVolume only")
		case op.info && len(req.GetParameters()) > 0:
			return invalid("GetVolumeReplicationInfo takes no parameters")
		}
		spec := replicationSpec(op.rpc, op.failedPrecondition)
		return o.withLock(ctx, kind, id, func() error {
			c := func(conn *grpc.ClientConn) replication.ControllerClient { return replication.NewControllerClient(conn) }
			var (
				preq  proto.Message
				call  func(ctx context.Context, conn *grpc.ClientConn) error
				ready = true
				info  *agentv1.ReplicationInfo
			)
			p, sec, rid, force := req.GetParameters(), req.GetSecrets(), req.GetReplicationId(), req.GetForce()
			switch op.rpc {
			case "EnableVolumeReplication":
				r := &replication.EnableVolumeReplicationRequest{VolumeId: volumeID, Parameters: p, Secrets: sec, ReplicationId: rid, ReplicationSource: src}
				preq, call = r, func(ctx context.Context, conn *grpc.ClientConn) error {
					_, err := c(conn).EnableVolumeReplication(ctx, r)
					return err
				}
			case "DisableVolumeReplication":
				r := &replication.DisableVolumeReplicationRequest{VolumeId: volumeID, Parameters: p, Secrets: sec, ReplicationId: rid, ReplicationSource: src}
				preq, call = r, func(ctx context.Context, conn *grpc.ClientConn) error {
					_, err := c(conn).DisableVolumeReplication(ctx, r)
					return err
				}
			case "PromoteVolume":
				r := &replication.PromoteVolumeRequest{VolumeId: volumeID, Force: force, Parameters: p, Secrets: sec, ReplicationId: rid, ReplicationSource: src}
				preq, call = r, func(ctx context.Context, conn *grpc.ClientConn) error {
					_, err := c(conn).PromoteVolume(ctx, r)
					return err
				}
			case "DemoteVolume":
				r := &replication.DemoteVolumeRequest{VolumeId: volumeID, Force: force, Parameters: p, Secrets: sec, ReplicationId: rid, ReplicationSource: src}
				preq, call = r, func(ctx context.Context, conn *grpc.ClientConn) error {
					_, err := c(conn).DemoteVolume(ctx, r)
					return err
				}
			case "ResyncVolume":
				r := &replication.ResyncVolumeRequest{VolumeId: volumeID, Force: force, Parameters: p, Secrets: sec, ReplicationId: rid, ReplicationSource: src}
				preq, call = r, func(ctx context.Context, conn *grpc.ClientConn) error {
					resp, err := c(conn).ResyncVolume(ctx, r)
					ready = resp.GetReady()
					return err
				}
			case "GetVolumeReplicationInfo":
				r := &replication.GetVolumeReplicationInfoRequest{VolumeId: volumeID, Secrets: sec, ReplicationId: rid, ReplicationSource: src}
				preq, call = r, func(ctx context.Context, conn *grpc.ClientConn) error {
					resp, err := c(conn).GetVolumeReplicationInfo(ctx, r)
					if err == nil {
						info = &agentv1.ReplicationInfo{LastSyncTime: resp.GetLastSyncTime(), LastSyncDuration: resp.GetLastSyncDuration(), LastSyncBytes: resp.GetLastSyncBytes()}
					}
					return err
				}
			default:
				return status.Errorf(codes.Internal, "unknown replication RPC %s", op.rpc)
			}
			if op.wait {
				var err error
				ready, err = o.untilReady(ctx, spec, req.GetNoWait(), fmt.Sprintf("the resync of %s %s", kind, id), func(ctx context.Context) (bool, error) {
					err := o.invoke(ctx, spec, preq, call)
					return ready, err
				})
				if err != nil {
					return err
				}
			} else if err := o.invoke(ctx, spec, preq, call); err != nil {
				return err
			}
			return stream.Send(&agentv1.ReplicationReply{Done: true, Ready: ready, Info: info})
		})
	}())
}

// Group snapshots.

// requireGroupSnapshots asks the plugin's GroupController for its
// capabilities: group snapshots need CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT.
func (o *ctrlOp) requireGroupSnapshots(ctx context.Context) error {
	spec := groupControllerSpec("GroupControllerGetCapabilities", nil)
	preq := &csi.GroupControllerGetCapabilitiesRequest{}
	var resp *csi.GroupControllerGetCapabilitiesResponse
	err := o.invoke(ctx, spec, preq, func(ctx context.Context, conn *grpc.ClientConn) (err error) {
		resp, err = csi.NewGroupControllerClient(conn).GroupControllerGetCapabilities(ctx, preq)
		return err
	})
	if status.Code(err) == codes.Unimplemented {
		return status.Errorf(codes.FailedPrecondition, "plugin %s does not support group snapshots: it does not serve %s (GroupControllerGetCapabilities is Unimplemented)", o.plugin, groupControllerService)
	}
	if err != nil {
		return err
	}
	var have []string
	for _, c := range resp.GetCapabilities() {
		t := c.GetRpc().GetType()
		if t == csi.GroupControllerServiceCapability_RPC_CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT {
			return nil
		}
		have = append(have, t.String())
	}
	return status.Errorf(codes.FailedPrecondition, "plugin %s does not support group snapshots: its group controller lacks the CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT capability (it reports [%s])",
		o.plugin, strings.Join(have, ", "))
}

func (s *controllerServer) CreateGroupSnapshot(req *agentv1.CreateGroupSnapshotRequest, stream grpc.ServerStreamingServer[agentv1.GroupSnapshotReply]) error {
	progress := func(p *agentv1.Progress) error { return stream.Send(&agentv1.GroupSnapshotReply{Progress: p}) }
	o, ctx, cancel, err := s.begin(stream.Context(), "CreateGroupSnapshot", req.GetPluginName(), req.GetRetry(), req, progress)
	if err != nil {
		return err
	}
	defer cancel()
	return o.finish(func() error {
		switch {
		case req.GetName() == "":
			return invalid("name is required: it makes the create idempotent")
		case len(req.GetSourceVolumeIds()) == 0:
			return invalid("source_volume_ids is required: the volumes to snapshot together")
		}
		if err := noEmpty("source_volume_ids", req.GetSourceVolumeIds()); err != nil {
			return err
		}
		if err := o.requireGroupSnapshots(ctx); err != nil {
			return err
		}
		return o.withLock(ctx, "group snapshot name", req.GetName(), func() error {
			spec := createGroupSnapshotSpec()
			preq := &csi.CreateVolumeGroupSnapshotRequest{Name: req.GetName(), SourceVolumeIds: req.GetSourceVolumeIds(), Secrets: req.GetSecrets(), Parameters: req.GetParameters()}
			var snap *csi.VolumeGroupSnapshot
			_, err := o.untilReady(ctx, spec, req.GetNoWait(), "group snapshot "+req.GetName(), func(ctx context.Context) (bool, error) {
				err := o.invoke(ctx, spec, preq, func(ctx context.Context, conn *grpc.ClientConn) error {
					resp, err := csi.NewGroupControllerClient(conn).CreateVolumeGroupSnapshot(ctx, preq)
					snap = resp.GetGroupSnapshot()
					return err
				})
				return snap.GetReadyToUse(), err
			})
			if err != nil {
				return err
			}
			return stream.Send(&agentv1.GroupSnapshotReply{GroupSnapshot: snap})
		})
	}())
}

// groupSnapshotRef checks the fields get and delete need.
func groupSnapshotRef(id string, snapshotIDs []string) error {
	switch {
	case id == "":
		return invalid("group_snapshot_id is required")
	case len(snapshotIDs) == 0:
		return invalid("snapshot_ids is required (CSI): the ids of the group's snapshots, as 'csi-agent group-snapshot create' printed them")
	}
	return noEmpty("snapshot_ids", snapshotIDs)
}

func (s *controllerServer) GetGroupSnapshot(req *agentv1.GetGroupSnapshotRequest, stream grpc.ServerStreamingServer[agentv1.GroupSnapshotReply]) error {
	progress := func(p *agentv1.Progress) error { return stream.Send(&agentv1.GroupSnapshotReply{Progress: p}) }
	o, ctx, cancel, err := s.begin(stream.Context(), "GetGroupSnapshot", req.GetPluginName(), req.GetRetry(), req, progress)
	if err != nil {
		return err
	}
	defer cancel()
	return o.finish(func() error {
		if err := groupSnapshotRef(req.GetGroupSnapshotId(), req.GetSnapshotIds()); err != nil {
			return err
		}
		if err := o.requireGroupSnapshots(ctx); err != nil {
			return err
		}
		preq := &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: req.GetGroupSnapshotId(), SnapshotIds: req.GetSnapshotIds(), Secrets: req.GetSecrets()}
		var resp *csi.GetVolumeGroupSnapshotResponse
		if err := o.invoke(ctx, getGroupSnapshotSpec(), preq, func(ctx context.Context, conn *grpc.ClientConn) (err error) {
			resp, err = csi.NewGroupControllerClient(conn).GetVolumeGroupSnapshot(ctx, preq)
			return err
		}); err != nil {
			return err
		}
		return stream.Send(&agentv1.GroupSnapshotReply{GroupSnapshot: resp.GetGroupSnapshot()})
	}())
}

func (s *controllerServer) DeleteGroupSnapshot(req *agentv1.DeleteGroupSnapshotRequest, stream grpc.ServerStreamingServer[agentv1.OperationReply]) error {
	progress := func(p *agentv1.Progress) error { return stream.Send(&agentv1.OperationReply{Progress: p}) }
	o, ctx, cancel, err := s.begin(stream.Context(), "DeleteGroupSnapshot", req.GetPluginName(), req.GetRetry(), req, progress)
	if err != nil {
		return err
	}
	defer cancel()
	return o.finish(func() error {
		if err := groupSnapshotRef(req.GetGroupSnapshotId(), req.GetSnapshotIds()); err != nil {
			return err
		}
		if err := o.requireGroupSnapshots(ctx); err != nil {
			return err
		}
		return o.withLock(ctx, "group snapshot", req.GetGroupSnapshotId(), func() error {
			preq := &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: req.GetGroupSnapshotId(), SnapshotIds: req.GetSnapshotIds(), Secrets: req.GetSecrets()}
			if err := o.invoke(ctx, deleteGroupSnapshotSpec(), preq, func(ctx context.Context, conn *grpc.ClientConn) error {
				_, err := csi.NewGroupControllerClient(conn).DeleteVolumeGroupSnapshot(ctx, preq)
				return err
			}); err != nil {
				return err
			}
			return stream.Send(&agentv1.OperationReply{Done: true})
		})
	}())
}
