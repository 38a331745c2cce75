package testhelp

import (
	"bufio"
	"fmt"
	"os"
	"regexp"
	"strings"
)

// ReadmeBlock is one ```sh block of a markdown file.
type ReadmeBlock struct {
	Line int    // of the opening fence
	Mark string // the walkthrough marker on the line before it, if any
	Text string
}

var walkthroughMarker = regexp.MustCompile(`^<!-- walkthrough: (.*) -->$`)

// ReadmeBlocks returns the ```sh blocks of the markdown file at path, in
// order, with their markers. An unknown marker, a marker not followed by a
// block and an unterminated block are errors.
func ReadmeBlocks(path string) ([]ReadmeBlock, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var (
		blocks   []ReadmeBlock
		cur      *ReadmeBlock
		body     strings.Builder
		mark     string
		markLine int
		n        int
	)
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		n++
		line := sc.Text()
		switch {
		case cur != nil && line == "```":
			cur.Text = body.String()
			blocks = append(blocks, *cur)
			cur = nil
		case cur != nil:
			body.WriteString(line + "\n")
		case strings.HasPrefix(line, "```"):
			if mark != "" && line != "```sh" {
				return nil, fmt.Errorf("%s:%d: walkthrough marker before a %q block", path, markLine, line)
			}
			if line == "```sh" {
				cur = &ReadmeBlock{Line: n, Mark: mark}
				body.Reset()
			}
			mark = ""
		case walkthroughMarker.MatchString(line):
			mark = walkthroughMarker.FindStringSubmatch(line)[1]
			markLine = n
			switch mark {
			case "systemd start", "systemd stop", "docker", "podman", "fails", "fleet":
			default:
				return nil, fmt.Errorf("%s:%d: unknown walkthrough marker %q", path, n, mark)
			}
		case mark != "":
			return nil, fmt.Errorf("%s:%d: walkthrough marker not followed by a ```sh block", path, markLine)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if cur != nil {
		return nil, fmt.Errorf("%s:%d: unterminated ```sh block", path, cur.Line)
	}
	return blocks, nil
}
