package testhelp

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestReadmeBlocksParse(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name, md string
		want     []ReadmeBlock
		err      string
	}{
		{"blocks and markers", "text\n```sh\na\nb\n```\n```json\n{}\n```\n<!-- walkthrough: fails -->\n```sh\nfalse\n```\n",
			[]ReadmeBlock{{Line: 2, Text: "a\nb\n"}, {Line: 10, Mark: "fails", Text: "false\n"}}, ""},
		{"unknown marker", "<!-- walkthrough: maybe -->\n```sh\nx\n```\n", nil, "unknown walkthrough marker"},
		{"marker without block", "<!-- walkthrough: fails -->\ntext\n", nil, "not followed by"},
		{"marker before json", "<!-- walkthrough: fails -->\n```json\n{}\n```\n", nil, "before a"},
		{"unterminated", "```sh\nx\n", nil, "unterminated"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "_")+".md")
			if err := os.WriteFile(p, []byte(tc.md), 0o600); err != nil {
				t.Fatal(err)
			}
			got, err := ReadmeBlocks(p)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err = %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil || fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Fatalf("got %+v, %v; want %+v", got, err, tc.want)
			}
		})
	}
}
