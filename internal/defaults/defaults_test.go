package defaults

import (
	"log/slog"
	"testing"
	"time"
)

func TestSet(t *testing.T) {
	d, n, keep := time.Duration(0), -3, 7
	Set(&d, time.Second)
	Set(&n, 4)
	Set(&keep, 9)
	if d != time.Second || n != 4 || keep != 7 {
		t.Fatalf("got %v, %d, %d; want 1s, 4, 7", d, n, keep)
	}
	dir, set := "", "/etc"
	Set(&dir, "/run")
	Set(&set, "/run")
	if dir != "/run" || set != "/etc" {
		t.Fatalf("got %q, %q; want /run, /etc", dir, set)
	}
}

func TestLogger(t *testing.T) {
	if Logger(nil) == nil {
		t.Fatal("Logger(nil) is nil")
	}
	l := slog.Default()
	if Logger(l) != l {
		t.Fatal("Logger replaced a given logger")
	}
}
