package cli

import (
	"strings"
	"testing"
)

// TestServeAPIGroupRootsErrors: --api-group-roots must be absolute clean
// prefixes other than "/", and is for --api-group members only.
func TestServeAPIGroupRootsErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"serve", "--api-group", "0", "--api-group-roots", "relative/dir"}, `--api-group-roots: "relative/dir" is not an absolute path`},
		{[]string{"serve", "--api-group", "0", "--api-group-roots", "/srv/a,/srv/b/../c"}, "is not a clean path"},
		{[]string{"serve", "--api-group", "0", "--api-group-roots", "/"}, "any host directory"},
		{[]string{"serve", "--api-group-roots", "/srv/roots"}, "--api-group-roots needs --api-group"},
	} {
		if code, _, errOut := run(t, c.args...); code != ExitUsage || !strings.Contains(errOut, c.want) {
			t.Errorf("%q: exit %d (%s), want %d and %q", c.args, code, errOut, ExitUsage, c.want)
		}
	}
}
