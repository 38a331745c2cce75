package cli

import (
	"context"
	"fmt"

	"github.com/spf13/pflag"

	"github.com/csiagent/csiagent/internal/bytesize"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// expandCmd is csi-agent expand: ControllerExpandVolume (the backend),
// then NodeExpandVolume on this host where the volume is published; the
// plugin is the one publishing the volume unless --plugin names it.
func (e *env) expandCmd(fs *pflag.FlagSet) runFunc {
	size := fs.String("size", "", "the size to reach, e.g. 2GiB (required when the plugin grows volumes on its backend; else default: what the backend holds)")
	run := e.withVolume(fs, func(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall, volume string) error {
		return e.expand(ctx, client, c, volume, *size)
	}, pluginOptional)
	fs.Lookup("plugin").Usage = "the plugin's type (default: the one publishing the volume on this host)"
	return run
}

// expand asks the agent to grow volume to size ("": what the backend holds).
func (e *env) expand(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall, volume, size string) error {
	var required int64
	if size != "" {
		n, err := bytesize.Parse(size)
		if err != nil {
			return usageError(fmt.Sprintf("--size: %v", err))
		}
		required = n
	}
	return runOp(ctx, c, client.ExpandVolume, &agentv1.ExpandVolumeRequest{PluginName: c.plugin, VolumeId: volume, RequiredBytes: required, Secrets: c.secrets, Retry: c.retry},
		func(res *agentv1.ExpandVolumeReply) error {
			if n := res.GetCapacityBytes(); n > 0 {
				fmt.Fprintf(c.e.stdout, "volume %s: expanded to %s\n", volume, bytesHuman(n))
			} else {
				fmt.Fprintf(c.e.stdout, "volume %s: expanded\n", volume)
			}
			return nil
		})
}
