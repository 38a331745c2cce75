package cgroup

import (
	"errors"
	"fmt"
	"math"
	"strconv"
)

const (
	// CPUPeriod is the cpu.max period, in microseconds: the kernel's
	// default CFS period.
	CPUPeriod = 100_000
	// MinCPUQuota is the smallest cpu.max quota, in microseconds, the
	// kernel accepts; a smaller positive cpus is raised to it.
	MinCPUQuota = 1_000
	// maxCPUQuota is the largest quota the kernel accepts (max_cfs_runtime,
	// 2^44-1 µs).
	maxCPUQuota = 1<<44 - 1
	// minMemory is the smallest memory limit worth setting: the kernel
	// rounds memory.max down to pages, and a limit of 0 pages kills
	// everything at once.
	minMemory = 4096
	mib       = 1 << 20
)

// ErrInvalidLimits marks cpus or mem values that cannot become limits.
var ErrInvalidLimits = errors.New("invalid resource limits")

// Limits are the cgroup v2 limits of one plugin container. The zero value
// limits nothing.
type Limits struct {
	// CPUQuota is the CPU time, in microseconds, the cgroup may use in each
	// CPUPeriod; 0 means no limit.
	CPUQuota int64
	// MemoryBytes is the memory.max of the cgroup; 0 means no limit.
	MemoryBytes int64
}

// LimitsFor turns the Mesos scalar resources cpus (CPUs, fractional) and mem
// (MiB) into Limits. Zero means no limit for either. Negative, NaN or
// infinite values, a mem under one page, and values beyond what the kernel
// accepts are errors wrapping ErrInvalidLimits.
func LimitsFor(cpus, memMiB float64) (Limits, error) {
	var l Limits
	switch {
	case math.IsNaN(cpus) || cpus < 0 || cpus*CPUPeriod > maxCPUQuota:
		return Limits{}, fmt.Errorf("cpus %v: %w", cpus, ErrInvalidLimits)
	case cpus > 0:
		l.CPUQuota = max(int64(math.Round(cpus*CPUPeriod)), MinCPUQuota)
	}
	switch {
	case math.IsNaN(memMiB) || memMiB < 0 || memMiB*mib >= math.MaxInt64:
		return Limits{}, fmt.Errorf("mem %v MiB: %w", memMiB, ErrInvalidLimits)
	case memMiB > 0:
		l.MemoryBytes = int64(memMiB * mib)
		if l.MemoryBytes < minMemory {
			return Limits{}, fmt.Errorf("mem %v MiB is less than a page: %w", memMiB, ErrInvalidLimits)
		}
	}
	return l, nil
}

// CPUMax is the content of cpu.max: "<quota> <period>", or "max <period>"
// for no limit.
func (l Limits) CPUMax() string {
	if l.CPUQuota <= 0 {
		return "max " + strconv.Itoa(CPUPeriod)
	}
	return strconv.FormatInt(l.CPUQuota, 10) + " " + strconv.Itoa(CPUPeriod)
}

// MemoryMax is the content of memory.max: a byte count, or "max" for no
// limit.
func (l Limits) MemoryMax() string {
	if l.MemoryBytes <= 0 {
		return "max"
	}
	return strconv.FormatInt(l.MemoryBytes, 10)
}
