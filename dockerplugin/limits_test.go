package dockerplugin

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// serveLimited serves h on a unix socket of its own with lim, as the agent
// does, and returns the socket.
func serveLimited(t *testing.T, h http.Handler, lim Limits) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "p.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	hs := lim.HTTPServer(h)
	go hs.Serve(lim.Listener(lis))
	t.Cleanup(func() { hs.Close() })
	return sock
}

// A client sending its body a byte at a time is disconnected once
// ReadTimeout has passed, not held for ever.
func TestSlowBodyIsCutOff(t *testing.T) {
	s, _ := newTestServer(t, &fakeBackend{containers: map[string]*statev1.PrepareRequest{}})
	lim := DefaultLimits
	lim.ReadTimeout = 300 * time.Millisecond
	sock := serveLimited(t, s.Handler(lim.CallTimeout), lim)
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	start := time.Now()
	// Far past ReadTimeout, and before the 1000-byte body is all sent.
	deadline := start.Add(10 * time.Second)
	if err := conn.SetDeadline(deadline); err != nil {
		t.Fatal(err)
	}
	if _, err := fmt.Fprint(conn, "POST /VolumeDriver.Get HTTP/1.1\r\nHost: plugin\r\nContent-Length: 1000\r\n\r\n{"); err != nil {
		t.Fatal(err)
	}
	go func() {
		for range 1000 {
			time.Sleep(20 * time.Millisecond)
			if _, err := conn.Write([]byte(" ")); err != nil {
				return
			}
		}
	}()
	// Returns without error when the server closes the connection.
	_, err = io.Copy(io.Discard, conn)
	elapsed := time.Since(start)
	if err != nil {
		t.Fatalf("a client sending its body a byte at a time still connected after %v (ReadTimeout %v): %v", elapsed, lim.ReadTimeout, err)
	}
	if elapsed < lim.ReadTimeout {
		t.Errorf("disconnected after %v, before ReadTimeout %v", elapsed, lim.ReadTimeout)
	}
}

// ReadTimeout bounds reading a request, not the call: a Mount longer
// than it is answered.
func TestCallsOutlastReadTimeout(t *testing.T) {
	lim := DefaultLimits
	lim.ReadTimeout = 100 * time.Millisecond
	b := &fakeBackend{containers: map[string]*statev1.PrepareRequest{}}
	b.prepare = func(ctx context.Context) error {
		select {
		case <-time.After(5 * lim.ReadTimeout):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	s, _ := newTestServer(t, b)
	sock := serveLimited(t, s.Handler(lim.CallTimeout), lim)
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}}
	resp, err := hc.Post("http://plugin/VolumeDriver.Mount", "application/json", strings.NewReader(`{"Name":"data","ID":"m1"}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "Mountpoint") {
		t.Errorf("a Mount longer than ReadTimeout: %s %s", resp.Status, body)
	}
}

// While MaxConns connections are held, the next one waits; it is served
// once one of them closes.
func TestConnectionsPastMaxConnsWait(t *testing.T) {
	s, _ := newTestServer(t, &fakeBackend{containers: map[string]*statev1.PrepareRequest{}})
	lim := DefaultLimits
	lim.MaxConns = 2
	sock := serveLimited(t, s.Handler(lim.CallTimeout), lim)
	var held []net.Conn
	for range lim.MaxConns {
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		// An answered request: the server has the connection, kept alive.
		if _, err := fmt.Fprint(c, "POST /Plugin.Activate HTTP/1.1\r\nHost: plugin\r\nContent-Length: 0\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("Activate: %s", resp.Status)
		}
		held = append(held, c)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := NewClient(sock).List(ctx)
		done <- err
	}()
	select {
	case err := <-done:
		t.Fatalf("a call on connection %d was answered (error %v) while %d were held", lim.MaxConns+1, err, lim.MaxConns)
	case <-time.After(300 * time.Millisecond):
	}
	held[0].Close()
	if err := <-done; err != nil {
		t.Errorf("the waiting call, once a held connection closed: %v", err)
	}
}
