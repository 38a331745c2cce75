package namedvol

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
)

// allow_annotations and share_engine_mounts take true or false, nothing
// else (not even the empty value block takes for true), with errors naming
// the option; share_engine_mounts needs allow_annotations.
func TestAnnotationOptions(t *testing.T) {
	base := func(kv ...string) map[string]string {
		o := map[string]string{KeyPlugin: "p", KeyVolumeID: "v"}
		for i := 0; i < len(kv); i += 2 {
			o[kv[i]] = kv[i+1]
		}
		return o
	}
	for _, tc := range []struct {
		opts         map[string]string
		allow, share bool
	}{
		{base(), false, false},
		{base(KeyAllowAnnotations, "false"), false, false},
		{base(KeyAllowAnnotations, "true"), true, false},
		{base(KeyAllowAnnotations, "true", KeyShareEngineMounts, "false"), true, false},
		{base(KeyAllowAnnotations, "true", KeyShareEngineMounts, "true"), true, true},
	} {
		d, err := ParseOptions("v", tc.opts)
		if err != nil || d.AllowAnnotations != tc.allow || d.ShareEngineMounts != tc.share {
			t.Errorf("ParseOptions(%v) = %+v, %v; want allow %v, share %v", tc.opts, d, err, tc.allow, tc.share)
			continue
		}
		// Options, as Get and List show them, parse back the same.
		back, err := ParseOptions("v", d.Options())
		if err != nil || back.AllowAnnotations != tc.allow || back.ShareEngineMounts != tc.share {
			t.Errorf("ParseOptions(%v) of Options() = %+v, %v", d.Options(), back, err)
		}
		if _, shown := d.Options()[KeyAllowAnnotations]; shown != tc.allow {
			t.Errorf("Options() %v shows %s: %v, want %v", d.Options(), KeyAllowAnnotations, shown, tc.allow)
		}
	}
	for _, tc := range []struct {
		opts map[string]string
		want string
	}{
		{base(KeyAllowAnnotations, ""), `option allow_annotations="": expected true or false`},
		{base(KeyAllowAnnotations, "yes"), `option allow_annotations="yes": expected true or false`},
		{base(KeyAllowAnnotations, "TRUE"), `option allow_annotations="TRUE": expected true or false`},
		{base(KeyAllowAnnotations, "1"), `option allow_annotations="1": expected true or false`},
		{base(KeyAllowAnnotations, strings.Repeat("t", 5000)), `option allow_annotations="tttt`},
		{base(KeyShareEngineMounts, "on"), `option share_engine_mounts="on": expected true or false`},
		{base(KeyShareEngineMounts, "true"), "option share_engine_mounts needs allow_annotations=true"},
		{base(KeyAllowAnnotations, "false", KeyShareEngineMounts, "true"), "option share_engine_mounts needs allow_annotations=true"},
	} {
		_, err := ParseOptions("v", tc.opts)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) || len(err.Error()) > 300 {
			t.Errorf("ParseOptions(%.80v) = %v, want ErrInvalid containing %q, short", tc.opts, err, tc.want)
		}
	}
}

// A definition stored before allow_annotations existed has no such field:
// it reads as not allowed (fail closed); one stored with it reads back
// allowed, under the JSON names of the options.
func TestStoredDefinitionWithoutAllowAnnotations(t *testing.T) {
	s := newTestStore(t)
	// As an older agent stored it.
	if _, err := s.commit.Put(s.path("old"), []byte(`{"name":"old","plugin":"p","volume_id":"v"}`+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	d, err := s.Get("old")
	if err != nil {
		t.Fatal(err)
	}
	if d.AllowAnnotations || d.ShareEngineMounts {
		t.Errorf("an old definition reads %+v: annotations allowed", d)
	}
	if _, shown := d.Options()[KeyAllowAnnotations]; shown {
		t.Errorf("an old definition shows options %v", d.Options())
	}
	n, err := ParseOptions("new", map[string]string{KeyPlugin: "p", KeyVolumeID: "v", KeyAllowAnnotations: "true", KeyShareEngineMounts: "true"})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Create(context.Background(), n); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(s.path("new"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"allow_annotations": true`, `"share_engine_mounts": true`} {
		if !strings.Contains(string(raw), want) {
			t.Errorf("stored %s, want %s", raw, want)
		}
	}
	if got, err := s.Get("new"); err != nil || !got.AllowAnnotations || !got.ShareEngineMounts {
		t.Errorf("read back %+v, %v", got, err)
	}
}
