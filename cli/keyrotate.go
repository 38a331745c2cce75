package cli

import (
	"context"
	"errors"
	"fmt"

	"github.com/spf13/pflag"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// keyRotateCmd is csi-agent keyrotate: EncryptionKeyRotate for a volume
// published on this host.
func (e *env) keyRotateCmd(fs *pflag.FlagSet) runFunc {
	params := paramFlag(fs, "plugin parameter")
	return e.withVolume(fs, func(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall, volume string) error {
		return runOp(ctx, c, client.RotateKey, &agentv1.RotateKeyRequest{PluginName: c.plugin, VolumeId: volume, Parameters: params.params(), Secrets: c.secrets, Retry: c.retry},
			func(res *agentv1.OperationReply) error {
				if !res.GetDone() {
					return errors.New("the agent ended the operation without a result")
				}
				fmt.Fprintf(c.e.stdout, "volume %s: encryption key rotated\n", volume)
				return nil
			})
	})
}
