package dockerplugin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"

	"github.com/docker/go-plugins-helpers/volume"
)

// maxAnswer bounds an answer the client reads. A larger answer is an
// error, never cut short.
const maxAnswer = 8 << 20

// Client calls a volume plugin endpoint as an engine does (the tests
// play Docker with it).
type Client struct {
	Socket string
	hc     *http.Client
}

// NewClient makes a client of the endpoint at socket.
func NewClient(socket string) *Client {
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", socket)
	}}
	return &Client{Socket: socket, hc: &http.Client{Transport: tr}}
}

// call posts req to path and decodes the answer into res (nil: ignored).
func (c *Client) call(ctx context.Context, path string, req, res any) error {
	body, err := json.Marshal(req)
	if err != nil {
		return fmt.Errorf("encoding the request: %w", err)
	}
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://plugin"+path, bytes.NewReader(body))
	if err != nil {
		return err
	}
	resp, err := c.hc.Do(hr)
	if err != nil {
		switch {
		case errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED):
			return fmt.Errorf("cannot reach the agent's volume plugin socket %s: is csi-agent serve running with it?: %w", c.Socket, err)
		case errors.Is(err, syscall.EACCES):
			return fmt.Errorf("may not connect to %s: only root and members of the agent's --api-group may: %w", c.Socket, err)
		}
		return err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxAnswer+1))
	if err != nil {
		return fmt.Errorf("reading the answer to %s: %w", path, err)
	}
	if len(data) > maxAnswer {
		return fmt.Errorf("the answer to %s is larger than the client's limit of %d bytes (%d MiB)", path, maxAnswer, maxAnswer>>20)
	}
	if resp.StatusCode != http.StatusOK {
		var e volume.ErrorResponse
		if json.Unmarshal(data, &e) == nil && e.Err != "" {
			return errors.New(e.Err)
		}
		return fmt.Errorf("%s: %s", resp.Status, strings.TrimSpace(string(data)))
	}
	if res == nil {
		return nil
	}
	if err := json.Unmarshal(data, res); err != nil {
		return fmt.Errorf("decoding the answer to %s: %w", path, err)
	}
	return nil
}

// Create defines a named volume.
func (c *Client) Create(ctx context.Context, name string, opts map[string]string) error {
	return c.call(ctx, "/VolumeDriver.Create", &volume.CreateRequest{Name: name, Options: opts}, nil)
}

// Remove deletes a named volume.
func (c *Client) Remove(ctx context.Context, name string) error {
	return c.call(ctx, "/VolumeDriver.Remove", &volume.RemoveRequest{Name: name}, nil)
}

// Get reports a named volume.
func (c *Client) Get(ctx context.Context, name string) (*volume.Volume, error) {
	var res volume.GetResponse
	if err := c.call(ctx, "/VolumeDriver.Get", &volume.GetRequest{Name: name}, &res); err != nil {
		return nil, err
	}
	return res.Volume, nil
}

// List reports every named volume.
func (c *Client) List(ctx context.Context) ([]*volume.Volume, error) {
	var all volume.ListResponse
	if err := c.call(ctx, "/VolumeDriver.List", struct{}{}, &all); err != nil {
		return nil, err
	}
	return all.Volumes, nil
}
