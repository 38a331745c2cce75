package cli

import "testing"

// TestDeviceRulesAllowed: a device is refused only when no rule allows it
// (no rule at all: refused, as runc does); a narrower deny after a
// wildcard allow does not count (runc's emulation keeps the wildcard).
func TestDeviceRulesAllowed(t *testing.T) {
	n := func(v int64) *int64 { return &v }
	denyAll := deviceRule{Allow: false, Access: "rwm"}
	for _, c := range []struct {
		name   string
		rules  []deviceRule
		access string
		want   bool
	}{
		{"no rules", nil, "r", false},
		{"deny all", []deviceRule{denyAll}, "r", false},
		{"exact rw", []deviceRule{denyAll, {Allow: true, Type: "b", Major: n(7), Minor: n(3), Access: "rw"}}, "rw", true},
		{"exact r, rw wanted", []deviceRule{denyAll, {Allow: true, Type: "b", Major: n(7), Minor: n(3), Access: "r"}}, "rw", false},
		{"exact r, r wanted", []deviceRule{denyAll, {Allow: true, Type: "b", Major: n(7), Minor: n(3), Access: "r"}}, "r", true},
		{"another minor", []deviceRule{denyAll, {Allow: true, Type: "b", Major: n(7), Minor: n(4), Access: "rwm"}}, "r", false},
		{"major wildcard (nil)", []deviceRule{denyAll, {Allow: true, Type: "b", Major: n(7), Access: "rw"}}, "rw", true},
		{"major wildcard (-1 minor)", []deviceRule{denyAll, {Allow: true, Type: "b", Major: n(7), Minor: n(-1), Access: "rw"}}, "rw", true},
		{"char rule", []deviceRule{denyAll, {Allow: true, Type: "c", Major: n(7), Minor: n(3), Access: "rw"}}, "r", false},
		{"privileged (allow all)", []deviceRule{{Allow: true, Access: "rwm"}}, "rw", true},
		{"allow all, empty access", []deviceRule{{Allow: true, Type: "a"}}, "rw", true},
		{"a narrower deny after a wildcard allow", []deviceRule{denyAll, {Allow: true, Type: "b", Major: n(7), Access: "rw"}, {Allow: false, Type: "b", Major: n(7), Minor: n(3), Access: "w"}}, "rw", true},
		{"later deny of w leaves r", []deviceRule{{Allow: true, Type: "b", Major: n(7), Access: "rw"}, {Allow: false, Type: "b", Major: n(7), Minor: n(3), Access: "w"}}, "r", true},
	} {
		if got := allowed(c.rules, 7, 3, c.access); got != c.want {
			t.Errorf("%s: allowed(%s) = %v, want %v", c.name, c.access, got, c.want)
		}
	}
}
