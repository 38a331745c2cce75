package pluginconfig

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// hangBound is how long a load may take in these tests before it counts
// as hung; a failure bound, far above the milliseconds a load takes.
const hangBound = 20 * time.Second

const goodNode = `"containers":[{"services":["NODE_SERVICE"],"command":{"value":"p"}}]`

// loadBounded runs LoadContext(dir) and fails the test, instead of hanging
// it, when the load does not return within hangBound.
func loadBounded(t *testing.T, dir string) *Set {
	t.Helper()
	type result struct {
		set *Set
		err error
	}
	done := make(chan result, 1)
	go func() {
		set, err := LoadContext(context.Background(), dir)
		done <- result{set, err}
	}()
	select {
	case r := <-done:
		if r.err != nil {
			t.Fatalf("Load: %v", r.err)
		}
		return r.set
	case <-time.After(hangBound):
		t.Fatalf("Load(%s) hung for %v", dir, hangBound)
	}
	return nil
}

// loadOneBad loads a directory of one good file and bad.json (content)
// and returns bad.json's error, checking that the good file loaded.
func loadOneBad(t *testing.T, content string) error {
	t.Helper()
	dir := t.TempDir()
	writeFile(t, dir, "good.json", `{"type":"good",`+goodNode+`}`)
	writeFile(t, dir, "bad.json", content)
	set := loadBounded(t, dir)
	if set.Plugins["good"] == nil || len(set.Plugins) != 1 {
		t.Errorf("the good file must load despite the bad one; plugins: %v", set.Plugins)
	}
	if len(set.Errors) != 1 || set.Errors[0].File != filepath.Join(dir, "bad.json") {
		t.Fatalf("want one error, for bad.json; got %v", set.Errors)
	}
	return set.Errors[0].Err
}

// TestNonRegularEntries: every entry that does not reach a regular file is
// an error for that entry, found without reading it (a FIFO without a
// writer, /dev/zero) and without hanging; directories not named like a
// config file are skipped, as Mesos does.
func TestNonRegularEntries(t *testing.T) {
	cases := []struct {
		name string
		make func(t *testing.T, path string)
		want string
	}{
		{"fifo without a writer", func(t *testing.T, path string) {
			if err := unix.Mkfifo(path, 0o644); err != nil {
				t.Fatal(err)
			}
		}, "not a regular file: it is a FIFO (named pipe); a config file must be (or link to) a regular file"},
		{"symlink to a fifo", func(t *testing.T, path string) {
			fifo := filepath.Join(t.TempDir(), "fifo")
			if err := unix.Mkfifo(fifo, 0o644); err != nil {
				t.Fatal(err)
			}
			symlink(t, fifo, path)
		}, "not a regular file: it is a FIFO (named pipe)"},
		{"symlink to /dev/zero", func(t *testing.T, path string) { symlink(t, "/dev/zero", path) },
			"not a regular file: it is a character device"},
		{"symlink to /dev/null", func(t *testing.T, path string) { symlink(t, "/dev/null", path) },
			"not a regular file: it is a character device"},
		{"directory named x.json", func(t *testing.T, path string) {
			if err := os.Mkdir(path, 0o755); err != nil {
				t.Fatal(err)
			}
		}, "not a regular file: it is a directory"},
		{"socket", func(t *testing.T, path string) {
			l, err := net.Listen("unix", path)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { l.Close() })
		}, "not a regular file: it is a socket"},
		{"dangling symlink", func(t *testing.T, path string) { symlink(t, "/nonexistent/x.json", path) },
			"cannot read: dangling symlink to /nonexistent/x.json: no such file or directory"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			writeFile(t, dir, "good.json", `{"type":"good",`+goodNode+`}`)
			if err := os.Mkdir(filepath.Join(dir, "backup"), 0o755); err != nil {
				t.Fatal(err)
			}
			tc.make(t, filepath.Join(dir, "x.json"))
			set := loadBounded(t, dir)
			if len(set.Errors) != 1 {
				t.Fatalf("want one error, for x.json; got %v", set.Errors)
			}
			if got := set.Errors[0]; got.File != filepath.Join(dir, "x.json") || !strings.HasPrefix(got.Err.Error(), tc.want) {
				t.Errorf("error = %v\nwant %s: %s…", got, filepath.Join(dir, "x.json"), tc.want)
			}
			if set.Plugins["good"] == nil || len(set.Plugins) != 1 {
				t.Errorf("plugins = %v, want good only", set.Plugins)
			}
		})
	}
}

func symlink(t *testing.T, target, path string) {
	t.Helper()
	if err := os.Symlink(target, path); err != nil {
		t.Fatal(err)
	}
}

// TestSizeCap: a file over maxFileSize is refused with the limit named;
// one at the limit is read.
func TestSizeCap(t *testing.T) {
	body := `{"type":"a",` + goodNode + `,"name":"b"}`
	pad := strings.Repeat(" ", maxFileSize-len(body))
	if err := loadOneBad(t, body+pad+" "); err.Error() != "larger than 1048576 bytes (1 MiB); a CSIPluginInfo file is a small JSON object" {
		t.Errorf("over the cap: %v", err)
	}
	dir := t.TempDir()
	writeFile(t, dir, "a.json", body+pad)
	if set := loadBounded(t, dir); len(set.Errors) != 0 || set.Plugins["a"] == nil {
		t.Errorf("a file of exactly %d bytes must load: %v", maxFileSize, set.Errors)
	}
}

// TestSyntaxErrorsQuoteNoByte: a syntax error gives the offending byte's
// place, never the byte, which would leak the start of whatever file a
// config symlink reaches (/etc/shadow) to whoever reads the error. Every
// context of encoding/json's "invalid character" messages is covered, the
// offending byte always a Q.
func TestSyntaxErrorsQuoteNoByte(t *testing.T) {
	cases := []struct{ content, want string }{
		{`Qroot:$6$secret`, "not valid JSON: expected a value at byte offset 0 (line 1, column 1)"},
		{"{\n  \"type\": Q}", "not valid JSON: expected a value at byte offset 12 (line 2, column 11)"},
		{`{Q}`, "not valid JSON: expected an object key (a string in double quotes) at byte offset 1 (line 1, column 2)"},
		{`{"type" Q}`, "not valid JSON: expected ':' after an object key at byte offset 8 (line 1, column 9)"},
		{`{"type":"a" Q}`, "not valid JSON: expected ',' or '}' after an object member at byte offset 12 (line 1, column 13)"},
		{`{"services":[1 Q]}`, "not valid JSON: expected ',' or ']' after an array element at byte offset 15 (line 1, column 16)"},
		{"{\"type\":\"a\x01Q\"}", "not valid JSON: control character in a string (escape it) at byte offset 10 (line 1, column 11)"},
		{`{"type":"\Q"}`, "not valid JSON: invalid escape in a string at byte offset 10 (line 1, column 11)"},
		{`{"type":"\uQQQQ"}`, "not valid JSON: invalid \\u escape in a string at byte offset 11 (line 1, column 12)"},
		{`{"name":-Q}`, "not valid JSON: invalid number at byte offset 9 (line 1, column 10)"},
		{`{"name":1.Q}`, "not valid JSON: invalid number at byte offset 10 (line 1, column 11)"},
		{`{"target_path_exists":tQue}`, "not valid JSON: invalid literal (expected true, false or null) at byte offset 23 (line 1, column 24)"},
		{`{} Q`, "more than one JSON value: text after the first at byte offset 3 (line 1, column 4); a config file holds one CSIPluginInfo object"},
	}
	for _, tc := range cases {
		t.Run(tc.content, func(t *testing.T) {
			err := loadOneBad(t, tc.content)
			if strings.ContainsAny(err.Error(), "Q\x01") {
				t.Errorf("error quotes the file's bytes: %v", err)
			}
			if err.Error() != tc.want {
				t.Errorf("error\n got: %v\nwant: %s", err, tc.want)
			}
		})
	}
	t.Run("nested too deeply", func(t *testing.T) {
		want := "not valid JSON: nested too deeply at byte offset 10000 (line 1, column 10001)"
		if err := loadOneBad(t, strings.Repeat("[", 10001)); err.Error() != want {
			t.Errorf("error\n got: %v\nwant: %s", err, want)
		}
	})
	t.Run("through a symlink", func(t *testing.T) {
		secret := filepath.Join(t.TempDir(), "shadow")
		if err := os.WriteFile(secret, []byte("Qoot:$6$Qsecret:19000::::::\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		dir := t.TempDir()
		symlink(t, secret, filepath.Join(dir, "x.json"))
		set := loadBounded(t, dir)
		if len(set.Errors) != 1 || strings.Contains(set.Errors[0].Err.Error(), "Q") || !strings.Contains(set.Errors[0].Err.Error(), "byte offset 0") {
			t.Errorf("errors = %v", set.Errors)
		}
	})
}

// TestDuplicateKeys: a key twice in one object, at any depth, is refused
// with the object's path (encoding/json would silently keep the last).
func TestDuplicateKeys(t *testing.T) {
	cases := []struct{ content, want string }{
		{`{"type":"a","type":"b",` + goodNode + `}`, `duplicate key "type"`},
		{`{"type":"a","containers":[{"services":["NODE_SERVICE"],"command":{"value":"p","value":"q"}}]}`,
			`containers[0].command: duplicate key "value"`},
		{`{"type":"a","containers":[{"services":["NODE_SERVICE"],"command":{"value":"p"},
			"resources":[{"name":"cpus","type":"SCALAR","scalar":{"value":1}},{"name":"mem","type":"SCALAR","scalar":{"value":64,"value":-1}}]}]}`,
			`containers[0].resources[1].scalar: duplicate key "value"`},
		{`{"type":"a",` + goodNode + `,"csiagent":{"reclaim_space":{"interval":"1h","interval":"0"}}}`,
			`csiagent.reclaim_space: duplicate key "interval"`},
		// Inside fields csiagent keeps as raw JSON, too.
		{`{"type":"a","containers":[{"services":["NODE_SERVICE"],"command":{"value":"p"},"container":{"type":"MESOS","type":"DOCKER"}}]}`,
			`containers[0].container: duplicate key "type"`},
	}
	for _, tc := range cases {
		t.Run(tc.want, func(t *testing.T) {
			if err := loadOneBad(t, tc.content); err.Error() != tc.want {
				t.Errorf("error\n got: %v\nwant: %s", err, tc.want)
			}
		})
	}
}

// TestResourceValues: resource amounts are never negative, never out of
// range, and ranges run forwards.
func TestResourceValues(t *testing.T) {
	res := func(r string) string {
		return `{"type":"a","containers":[{"services":["NODE_SERVICE"],"command":{"value":"p"},"resources":[` + r + `]}]}`
	}
	cases := []struct{ content, want string }{
		{res(`{"name":"cpus","type":"SCALAR","scalar":{"value":-0.5}}`), "containers[0].resources[0].scalar.value: cpus must not be negative, got -0.5"},
		{res(`{"name":"cpus","type":"SCALAR","scalar":{"value":1}},{"name":"mem","type":"SCALAR","scalar":{"value":-1024}}`),
			"containers[0].resources[1].scalar.value: mem must not be negative, got -1024"},
		{res(`{"name":"mem","type":"SCALAR","scalar":{"value":1e400}}`), "containers[0].resources[0].scalar.value: 1e400 is out of range for a number"},
		{res(`{"name":"mem","type":"SCALAR","scalar":{"value":-1e400}}`), "containers[0].resources[0].scalar.value: -1e400 is out of range for a number"},
		{res(`{"name":"ports","type":"RANGES","ranges":{"range":[{"begin":-1,"end":5}]}}`),
			"containers[0].resources[0].ranges.range[0].begin: expected a non-negative integer, got -1"},
		{res(`{"name":"ports","type":"RANGES","ranges":{"range":[{"begin":1,"end":18446744073709551616}]}}`),
			"containers[0].resources[0].ranges.range[0].end: 18446744073709551616 is out of range (at most 18446744073709551615)"},
		{res(`{"name":"ports","type":"RANGES","ranges":{"range":[{"begin":9,"end":5}]}}`),
			"containers[0].resources[0].ranges.range[0]: begin 9 is after end 5"},
		{res(`{"name":"ports","type":"RANGES","ranges":{"rnge":[]}}`),
			`containers[0].resources[0].ranges.rnge: unknown field; did you mean "range"?`},
	}
	for _, tc := range cases {
		t.Run(tc.want, func(t *testing.T) {
			if err := loadOneBad(t, tc.content); err.Error() != tc.want {
				t.Errorf("error\n got: %v\nwant: %s", err, tc.want)
			}
		})
	}
	t.Run("zero and ranges are valid", func(t *testing.T) {
		info, err := Parse([]byte(res(`{"name":"cpus","type":"SCALAR","scalar":{"value":0}},{"name":"ports","type":"RANGES","ranges":{"range":[{"begin":31000,"end":31000}]}}`)))
		if err != nil {
			t.Fatal(err)
		}
		if r := info.Containers[0].Resources[1].Ranges; r == nil || len(r.Range) != 1 || r.Range[0].Begin != 31000 {
			t.Errorf("ranges = %+v", r)
		}
	})
}

// TestReadDeadline: a read that never returns (a hung file system) is
// given up after the timeout, or as soon as the context ends.
func TestReadDeadline(t *testing.T) {
	block := make(chan struct{})
	defer close(block)
	blocked := func(time.Time) ([]byte, error) {
		<-block
		return nil, nil
	}
	start := time.Now()
	_, err := within(context.Background(), 50*time.Millisecond, blocked)
	if err == nil || err.Error() != "cannot read: not read within 50ms (a hung file system?)" {
		t.Errorf("err = %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := within(ctx, hangBound, blocked); !errors.Is(err, context.Canceled) {
		t.Errorf("err = %v, want context.Canceled", err)
	}
	if d := time.Since(start); d > hangBound/2 {
		t.Errorf("took %v", d)
	}
}

// TestLoadContextCancelled: a load whose context has ended stops with an
// error, not a partial set (check-config on SIGINT, the watcher on stop).
func TestLoadContextCancelled(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, dir, "a.json", `{"type":"a",`+goodNode+`}`)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	set, err := LoadContext(ctx, dir)
	if !errors.Is(err, context.Canceled) || set != nil || !strings.Contains(err.Error(), "interrupted") {
		t.Fatalf("LoadContext(cancelled) = %v, %v", set, err)
	}
}

// TestWatchFIFOOverLiveConfig: a FIFO put in place of a live config is an
// invalid file, reported once, and the plugin keeps its last good config
// (it used to be skipped, which removed the plugin); the watcher is not
// wedged and sees the file fixed.
func TestWatchFIFOOverLiveConfig(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, dir, "a.json", pluginJSON("a", "v1"))
	w, _ := startWatch(t, dir)
	nextUpdate(t, w)
	tmp := filepath.Join(dir, ".a.json.tmp")
	if err := unix.Mkfifo(tmp, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, "a.json")); err != nil {
		t.Fatal(err)
	}
	u := nextUpdate(t, w)
	if summary(u) != "invalid:a" || command(u, "a") != "v1" {
		t.Fatalf("after the FIFO: %q, command %q; want the plugin kept", summary(u), command(u, "a"))
	}
	if ev := u.Events[0]; ev.File != filepath.Join(dir, "a.json") || ev.Err == nil || !strings.Contains(ev.Err.Error(), "it is a FIFO") {
		t.Errorf("invalid event = %+v", ev)
	}
	if len(u.Errors) != 1 || u.Errors[0].File != filepath.Join(dir, "a.json") {
		t.Errorf("update errors = %v", u.Errors)
	}
	if err := os.Remove(filepath.Join(dir, "a.json")); err != nil {
		t.Fatal(err)
	}
	writeFile(t, dir, "a.json", pluginJSON("a", "v2"))
	if u = nextUpdate(t, w); summary(u) != "changed:a" || command(u, "a") != "v2" {
		t.Fatalf("after the fix: %q, command %q", summary(u), command(u, "a"))
	}
}
