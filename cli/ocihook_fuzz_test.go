package cli

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// FuzzOCIHookInput feeds arbitrary bytes to the OCI hook's parsers: the
// container state on stdin, the volumes annotation inside it, and the
// bundle's config.json. None may panic; what they accept must be usable:
// a rootfs is an absolute clean path, volumes parse to messages, and a
// state bigger than the hook's limit is refused rather than read whole.
func FuzzOCIHookInput(f *testing.F) {
	anno, _ := json.Marshal(`[{"container_path":"/data","mode":"RW","source":{"type":"CSI_VOLUME","csi_volume":{"plugin_name":"loop","static_provisioning":{"volume_id":"v","volume_capability":{"mount":{},"access_mode":{"mode":"SINGLE_NODE_WRITER"}}}}}}]`)
	state := `{"ociVersion":"1.0.2","id":"c1","status":"creating","pid":42,"bundle":"BUNDLE","annotations":{"csi.csiagent.io/volumes":` + string(anno) + `}}`
	for _, s := range []struct{ state, config string }{
		{state, `{"root":{"path":"rootfs"}}`},
		{state, `{"root":{"path":"/abs/rootfs/"}}`},
		{state, `{"root":{"path":"../../../../etc"}}`},
		{`{"id":"c1","annotations":{"csi.csiagent.io/volumes":"[{\"mode\":7}]"}}`, `{"root":{}}`},
		{`{"id":"c1","annotations":{"csi.csiagent.io/volumes":"{\"not\":\"a list\"}"}}`, `[]`},
		{`{"id":"../x","pid":-1,"annotations":{"csi.csiagent.io/volumes":"[null,1,\"x\"]"}}`, `null`},
		{`{"pid":1e99}`, `{"root":{"path":"\u0000"}}`},
		{``, ``}, {`null`, `{`},
	} {
		f.Add([]byte(s.state), []byte(s.config))
	}
	f.Fuzz(func(t *testing.T, stateIn, config []byte) {
		bundle := t.TempDir()
		stateIn = bytes.ReplaceAll(stateIn, []byte("BUNDLE"), []byte(bundle))
		st, err := readOCIState(bytes.NewReader(stateIn))
		if err != nil {
			if !strings.Contains(err.Error(), "container state") {
				t.Fatalf("error %q does not say what failed", err)
			}
			return
		}
		if raw, ok := st.Annotations[VolumesAnnotation]; ok {
			vols, err := parseVolumes([]byte(raw))
			if err == nil {
				for i, v := range vols {
					if v == nil {
						t.Fatalf("volume %d parsed to nil", i)
					}
				}
			}
		}
		if err := os.WriteFile(filepath.Join(bundle, "config.json"), config, 0o600); err != nil {
			t.Fatal(err)
		}
		b, err := readBundle(bundle)
		if err == nil && (!filepath.IsAbs(b.rootfs) || filepath.Clean(b.rootfs) != b.rootfs) {
			t.Fatalf("rootfs %q is not an absolute clean path", b.rootfs)
		}
		if u, g, ok := strings.Cut(b.user, ":"); b.user != "" && (!ok || u == "" || g == "") {
			t.Fatalf("user %q is not UID:GID", b.user)
		}
		if !filepath.IsAbs(st.Bundle) {
			if _, err := readBundle(st.Bundle); err == nil {
				t.Fatalf("relative bundle %q accepted", st.Bundle)
			}
		}
	})
}

// TestOCIStateTooBig: a state beyond the hook's limit is cut off and
// refused, not read into memory whole.
func TestOCIStateTooBig(t *testing.T) {
	big := `{"id":"c1","annotations":{"x":"` + strings.Repeat("a", maxOCIState) + `"}}`
	if _, err := readOCIState(strings.NewReader(big)); err == nil {
		t.Fatal("a state over the limit was accepted")
	}
}
