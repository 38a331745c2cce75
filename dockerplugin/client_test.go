package dockerplugin

import (
	"context"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
)

// The client reads answers up to maxAnswer and fails, naming the limit,
// on a longer one: never a silently cut answer.
func TestClientAnswerLimit(t *testing.T) {
	const head, tail = `{"Volumes":[{"Name":"v"}`, `]}`
	var size atomic.Int64
	size.Store(maxAnswer)
	sock := filepath.Join(t.TempDir(), "p.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	// A valid answer of size bytes: the padding is JSON white space.
	hs := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Write([]byte(head + strings.Repeat(" ", int(size.Load())-len(head)-len(tail)) + tail))
	})}
	go hs.Serve(lis)
	t.Cleanup(func() { hs.Close() })
	c := NewClient(sock)
	vols, err := c.List(context.Background())
	if err != nil || len(vols) != 1 || vols[0].Name != "v" {
		t.Fatalf("an answer of exactly %d bytes: %v, %v", maxAnswer, vols, err)
	}
	size.Store(maxAnswer + 1)
	_, err = c.List(context.Background())
	if err == nil || !strings.Contains(err.Error(), "larger than the client's limit of 8388608 bytes") {
		t.Errorf("an answer of %d bytes: %v, want an error naming the limit", maxAnswer+1, err)
	}
}
