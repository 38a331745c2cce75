package cgroup

import (
	"errors"
	"math"
	"testing"
)

func TestLimitsFor(t *testing.T) {
	tests := []struct {
		name      string
		cpus, mem float64
		want      Limits
		cpuMax    string
		memoryMax string
	}{
		{name: "no limits", cpus: 0, mem: 0, want: Limits{}, cpuMax: "max 100000", memoryMax: "max"},
		{name: "one cpu", cpus: 1, mem: 128, want: Limits{CPUQuota: 100000, MemoryBytes: 128 << 20}, cpuMax: "100000 100000", memoryMax: "134217728"},
		{name: "fractions", cpus: 0.25, mem: 0.5, want: Limits{CPUQuota: 25000, MemoryBytes: 512 << 10}, cpuMax: "25000 100000", memoryMax: "524288"},
		{name: "several cpus", cpus: 2.5, mem: 0, want: Limits{CPUQuota: 250000}, cpuMax: "250000 100000", memoryMax: "max"},
		{name: "quota rounds", cpus: 0.123456, want: Limits{CPUQuota: 12346}, cpuMax: "12346 100000", memoryMax: "max"},
		{name: "tiny cpus get the minimum quota", cpus: 0.001, want: Limits{CPUQuota: MinCPUQuota}, cpuMax: "1000 100000", memoryMax: "max"},
		{name: "tinier cpus too", cpus: 1e-9, want: Limits{CPUQuota: MinCPUQuota}, cpuMax: "1000 100000", memoryMax: "max"},
		{name: "memory only", mem: 1024, want: Limits{MemoryBytes: 1 << 30}, cpuMax: "max 100000", memoryMax: "1073741824"},
		{name: "one page", mem: 4096.0 / (1 << 20), want: Limits{MemoryBytes: 4096}, cpuMax: "max 100000", memoryMax: "4096"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := LimitsFor(tt.cpus, tt.mem)
			if err != nil {
				t.Fatal(err)
			}
			if got != tt.want {
				t.Errorf("LimitsFor(%v, %v) = %+v, want %+v", tt.cpus, tt.mem, got, tt.want)
			}
			if s := got.CPUMax(); s != tt.cpuMax {
				t.Errorf("CPUMax() = %q, want %q", s, tt.cpuMax)
			}
			if s := got.MemoryMax(); s != tt.memoryMax {
				t.Errorf("MemoryMax() = %q, want %q", s, tt.memoryMax)
			}
		})
	}
}

func TestLimitsForInvalid(t *testing.T) {
	tests := []struct {
		name      string
		cpus, mem float64
	}{
		{"negative cpus", -1, 0},
		{"NaN cpus", math.NaN(), 0},
		{"infinite cpus", math.Inf(1), 0},
		{"more cpus than the kernel takes", 2e8, 0},
		{"negative mem", 0, -0.5},
		{"NaN mem", 0, math.NaN()},
		{"infinite mem", 0, math.Inf(1)},
		{"mem beyond int64", 0, 1e13},
		{"mem under a page", 0, 1e-6},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := LimitsFor(tt.cpus, tt.mem)
			if !errors.Is(err, ErrInvalidLimits) {
				t.Fatalf("LimitsFor(%v, %v) = %+v, %v; want ErrInvalidLimits", tt.cpus, tt.mem, got, err)
			}
		})
	}
}
