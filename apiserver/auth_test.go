package apiserver

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestPermitted(t *testing.T) {
	self := os.Getpid()
	for _, c := range []struct {
		name  string
		group int
		cred  unix.Ucred
		want  bool
	}{
		{"root, no API group", -1, unix.Ucred{Uid: 0, Gid: 0, Pid: int32(self)}, true},
		{"another user, no API group", -1, unix.Ucred{Uid: 1000, Gid: 1000, Pid: int32(self)}, false},
		{"primary group is the API group", 1000, unix.Ucred{Uid: 1000, Gid: 1000, Pid: int32(self)}, true},
		{"another group, process gone", 4242, unix.Ucred{Uid: 1000, Gid: 1000, Pid: 1 << 30}, false},
	} {
		if got := (Access{Group: c.group}).Permitted(&c.cred); got != c.want {
			t.Errorf("%s: Permitted = %v, want %v", c.name, got, c.want)
		}
	}
}

// TestHTTPPeerCheck serves a handler on a real unix socket: the caller's
// credentials are read from the connection (this test's own process).
func TestHTTPPeerCheck(t *testing.T) {
	me := os.Getuid()
	for _, c := range []struct {
		name   string
		access Access
		want   int
	}{
		{"the API group is the caller's group", Access{Group: os.Getgid()}, http.StatusOK},
		{"no API group", Access{Group: -1}, map[bool]int{true: http.StatusOK, false: http.StatusForbidden}[me == 0]},
	} {
		t.Run(c.name, func(t *testing.T) {
			sock := filepath.Join(t.TempDir(), "s.sock")
			lis, err := net.Listen("unix", sock)
			if err != nil {
				t.Fatal(err)
			}
			srv := &http.Server{ConnContext: ConnContext, Handler: c.access.HTTP(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				io.WriteString(w, "served")
			}))}
			go srv.Serve(lis)
			defer srv.Close()
			client := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				return (&net.Dialer{}).DialContext(ctx, "unix", sock)
			}}}
			resp, err := client.Get("http://agent/VolumeDriver.List")
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != c.want {
				t.Fatalf("status %d (%s), want %d", resp.StatusCode, body, c.want)
			}
			if c.want == http.StatusForbidden && (!strings.Contains(string(body), `"Err"`) || !strings.Contains(string(body), "only root may")) {
				t.Errorf("refusal %q is not a plugin-protocol error saying only root may", body)
			}
		})
	}
}

func TestHTTPWithoutCredentialsIsRefused(t *testing.T) {
	rec := httptest.NewRecorder()
	req, _ := http.NewRequest(http.MethodPost, "/VolumeDriver.Mount", nil)
	(Access{Group: -1}).HTTP(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
		t.Error("served a request without peer credentials")
	})).ServeHTTP(rec, req)
	if rec.Code != http.StatusForbidden {
		t.Errorf("status %d, want 403", rec.Code)
	}
}
