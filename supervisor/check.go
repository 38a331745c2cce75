package supervisor

import (
	"errors"
	"fmt"
	"path/filepath"

	"github.com/csiagent/csiagent/pluginconfig"
)

// socketPath is where a managed plugin's container i serves:
// <runtimeDir>/csi/<type>/<name>/c<i>.sock.
func socketPath(runtimeDir string, info *pluginconfig.PluginInfo, i int) string {
	return filepath.Join(runtimeDir, "csi", info.Type, info.Name, fmt.Sprintf("c%d.sock", i))
}

// checkSocketPath refuses a socket path a unix socket address cannot hold.
func checkSocketPath(socket string) error {
	if len(socket) > MaxSocketPath {
		return fmt.Errorf("socket path %s is %d bytes, longer than the %d a unix socket address holds; use a shorter --runtime-dir, plugin type or name",
			socket, len(socket), MaxSocketPath)
	}
	return nil
}

// CheckLaunch reports what the config of a managed plugin shows would stop
// its containers from launching under an agent with runtimeDir (each
// container's error, joined): a socket path too long for a unix socket
// address, resources (cpus, mem) no cgroup limit can hold. An unmanaged
// plugin launches nothing: nil.
func CheckLaunch(p *pluginconfig.Plugin, runtimeDir string) error {
	var errs []error
	for i, c := range p.Info.Containers {
		err := checkSocketPath(socketPath(runtimeDir, p.Info, i))
		if _, _, lerr := limitsOf(c.Resources); lerr != nil {
			err = errors.Join(err, lerr)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("containers[%d]: %w", i, err))
		}
	}
	return errors.Join(errs...)
}
