package controllerops

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/retrypolicy"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	ekr "github.com/csiagent/csiagent/proto/encryptionkeyrotation"
)

// KeyRotationService is the csi-addons key rotation service, as discovery
// names it. Node plugins serve it.
const KeyRotationService = "encryptionkeyrotation.EncryptionKeyRotationController"

// keyRotateSpec is EncryptionKeyRotate's error table (upstream
// encryptionkeyrotation/README.md).
func keyRotateSpec() rpcSpec {
	return rpcSpec{service: KeyRotationService, method: "EncryptionKeyRotate", node: true, table: map[codes.Code]recovery{
		codes.InvalidArgument: {false, "a required field is missing: fix the request"},
		codes.NotFound:        {true, "the plugin does not know the volume: verify the id and that it has not been deleted"},
	}}
}

// RotateKey rotates the encryption key of a volume published on this host,
// one operation per volume at a time.
func (s *Server) RotateKey(req *agentv1.RotateKeyRequest, stream grpc.ServerStreamingServer[agentv1.OperationReply]) error {
	return serve(s, "RotateKey", req, stream, operationProgress, func(ctx context.Context, o *op) error {
		if err := s.rotateKey(ctx, o, req.GetVolumeId(), req.GetParameters(), req.GetSecrets()); err != nil {
			return err
		}
		return stream.Send(&agentv1.OperationReply{Done: true})
	})
}

// RotateKeyOnce makes one EncryptionKeyRotate call for a published volume
// (no parameters, no secrets), under the same per-volume lock as
// RotateKey: for a schedule, which retries by its own rules. The error is
// the plugin's status error, or FailedPrecondition when the volume is not
// published here.
func (s *Server) RotateKeyOnce(ctx context.Context, plugin, id string) error {
	o := &op{s: s, plugin: plugin, policy: retrypolicy.Policy{Attempts: 1}, progress: func(*agentv1.Progress) error { return nil }}
	return asStatus(s.rotateKey(ctx, o, id, nil, nil))
}

func (s *Server) rotateKey(ctx context.Context, o *op, id string, params, secrets map[string]string) error {
	if id == "" {
		return invalid("volume_id is required: a volume published on this host")
	}
	pv, ok := s.plugins.Published(o.plugin, id)
	if !ok {
		return status.Errorf(codes.FailedPrecondition, "volume %s of plugin %s is not published on this host: its key is rotated where it is published", id, o.plugin)
	}
	return o.withLock(ctx, "volume", id, func(ctx context.Context) error {
		preq := &ekr.EncryptionKeyRotateRequest{VolumeId: id, VolumePath: pv.TargetPath, Parameters: params, Secrets: secrets}
		_, err := callPlugin(ctx, o, keyRotateSpec(), ekr.NewEncryptionKeyRotationControllerClient, ekr.EncryptionKeyRotationControllerClient.EncryptionKeyRotate, preq)
		return err
	})
}
