package bytesize

import (
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
	}{
		{"1GiB", 1 << 30},
		{"512MiB", 512 << 20},
		{"10G", 10 << 30},
		{"4096", 4096},
		{"1 TiB", 1 << 40},
		{"3KB", 3000},
		{"2GB", 2e9},
		{"7B", 7},
		{"", 0},
		{"0", 0},
		{"-1GiB", 0},
		{"1.5GiB", 0},
		{"lots", 0},
		{"99999999999TiB", 0},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := Parse(tc.in)
			if tc.want == 0 {
				if err == nil || !strings.Contains(err.Error(), `"`+tc.in+`"`) {
					t.Fatalf("Parse = %d, %v; want an error naming %q", got, err, tc.in)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("Parse = %d, %v; want %d", got, err, tc.want)
			}
		})
	}
}
