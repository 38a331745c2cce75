package dockerplugin

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
)

// maxDockerAnswer bounds the container list read from the Docker daemon.
const maxDockerAnswer = 256 << 20

// DockerVolumes asks the Docker daemon at host (unix:///path) for its data
// root (which tells it from another daemon), which named volumes it knows,
// and which of them its containers may hold mounted:
// those of every container but an exited or dead one (a container being
// created or started holds its mounts already). Docker forgets to unmount
// the volumes of containers that were running when it was killed; what it
// lists as exited holds nothing. A volume it does not know is another
// daemon's business.
func DockerVolumes(ctx context.Context, host string) (root string, known, inUse map[string]bool, err error) {
	u, err := url.Parse(host)
	if err != nil || u.Scheme != "unix" || u.Path == "" {
		return "", nil, nil, fmt.Errorf("docker host %q: expected unix:///path", host)
	}
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", u.Path)
	}}}
	defer hc.CloseIdleConnections()
	var info struct{ DockerRootDir string }
	if err := dockerGet(ctx, hc, u.Path, "/info", &info); err != nil {
		return "", nil, nil, err
	}
	var vols struct{ Volumes []struct{ Name string } }
	if err := dockerGet(ctx, hc, u.Path, "/volumes", &vols); err != nil {
		return "", nil, nil, err
	}
	var containers []struct {
		State  string
		Mounts []struct{ Type, Name string }
	}
	if err := dockerGet(ctx, hc, u.Path, "/containers/json?all=1", &containers); err != nil {
		return "", nil, nil, err
	}
	known, inUse = map[string]bool{}, map[string]bool{}
	for _, v := range vols.Volumes {
		known[v.Name] = true
	}
	for _, c := range containers {
		if c.State == "exited" || c.State == "dead" {
			continue
		}
		for _, m := range c.Mounts {
			if m.Type == "volume" {
				inUse[m.Name] = true
			}
		}
	}
	return info.DockerRootDir, known, inUse, nil
}

// dockerGet decodes the answer to GET path of the Docker API into out.
func dockerGet(ctx context.Context, hc *http.Client, socket, path string, out any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://docker"+path, nil)
	if err != nil {
		return err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return fmt.Errorf("asking Docker at %s (GET %s): %w", socket, path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("asking Docker at %s (GET %s): %s: %s", socket, path, resp.Status, strings.TrimSpace(string(b)))
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, maxDockerAnswer)).Decode(out); err != nil {
		return fmt.Errorf("reading Docker's answer to GET %s: %w", path, err)
	}
	return nil
}
