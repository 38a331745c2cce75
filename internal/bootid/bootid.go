package bootid

import (
	"fmt"
	"os"
	"strings"
)

// Path is where the kernel publishes the boot id.
const Path = "/proc/sys/kernel/random/boot_id"

// Current is this boot's id.
func Current() (string, error) {
	b, err := os.ReadFile(Path)
	if err != nil {
		return "", fmt.Errorf("reading the boot id: %w", err)
	}
	return strings.TrimSpace(string(b)), nil
}
