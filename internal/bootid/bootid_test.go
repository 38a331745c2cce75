package bootid

import "testing"

// TestCurrent: the kernel's boot id, a UUID, the same on every read.
func TestCurrent(t *testing.T) {
	a, err := Current()
	if err != nil {
		t.Fatal(err)
	}
	b, err := Current()
	if err != nil {
		t.Fatal(err)
	}
	if len(a) != 36 || a != b {
		t.Fatalf("boot ids %q, %q: want one UUID", a, b)
	}
}
