package volumestats

import (
	"context"
	"hash/fnv"
	"log/slog"
	"sync"
	"time"

	"github.com/csiagent/csiagent/internal/defaults"
)

// Defaults for Config's zero fields.
const (
	DefaultInterval      = time.Minute
	DefaultMaxConcurrent = 4
	DefaultCallTimeout   = 10 * time.Second
	// rescan bounds how long a newly published volume waits to be seen:
	// the volume list is read again at most this often.
	rescan = 10 * time.Second
	// maxTick is the poller's coarsest wake-up granularity: volumes due
	// within one tick (a sixtieth of the interval, at most this) are
	// polled together; 10,000 volumes at one-minute slots would otherwise
	// wake it every 6 ms.
	maxTick = time.Second
)

// Volume is one published volume and where it is.
type Volume struct {
	Plugin, ID              string
	TargetPath, StagingPath string
}

// Key names a volume.
type Key struct{ Plugin, ID string }

// Usage is one unit's figures; Known is false when the plugin did not
// report the unit.
type Usage struct {
	Known                  bool
	Total, Used, Available int64
}

// Stats is one poll's result.
type Stats struct {
	At time.Time
	// Bytes and Inodes as the plugin reports them.
	Bytes, Inodes Usage
	// HealthKnown: the plugin reported health; Abnormal with Condition
	// (its messages) when it reported adverse conditions.
	HealthKnown bool
	Abnormal    bool
	Condition   string
	// Err is why the poll failed (nothing else is set then).
	Err error
}

// Source lists the volumes to poll and polls one.
type Source interface {
	Volumes() []Volume
	Poll(ctx context.Context, v Volume) Stats
}

// Config configures a Poller.
type Config struct {
	Source        Source
	Interval      time.Duration
	MaxConcurrent int
	CallTimeout   time.Duration
	Logger        *slog.Logger
}

// Poller polls volumes; its zero value is not usable, use New.
type Poller struct {
	cfg  Config
	sem  chan struct{}
	mu   sync.Mutex
	last map[Key]Stats
	due  map[Key]time.Time
	busy map[Key]bool
}

// New returns a Poller; it polls nothing until Run or Refresh. An
// Interval of 0 or less turns periodic polling off (Run returns at once);
// Refresh still polls.
func New(cfg Config) *Poller {
	defaults.Set(&cfg.MaxConcurrent, DefaultMaxConcurrent)
	defaults.Set(&cfg.CallTimeout, DefaultCallTimeout)
	cfg.Logger = defaults.Logger(cfg.Logger)
	return &Poller{cfg: cfg, sem: make(chan struct{}, cfg.MaxConcurrent),
		last: map[Key]Stats{}, due: map[Key]time.Time{}, busy: map[Key]bool{}}
}

// slot is the volume's first due time after now: its offset in the
// interval, fixed by a hash of its key.
func (p *Poller) slot(k Key, now time.Time) time.Time {
	h := fnv.New64a()
	h.Write([]byte(k.Plugin + "\x00" + k.ID))
	iv := p.cfg.Interval
	off := time.Duration(h.Sum64() % uint64(iv))
	start := now.Truncate(iv).Add(off)
	if start.Before(now) {
		start = start.Add(iv)
	}
	return start
}

// Run polls until ctx ends, then waits for the calls in flight. With
// periodic polling off it returns at once.
func (p *Poller) Run(ctx context.Context) {
	if p.cfg.Interval <= 0 {
		return
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	var vols []Volume
	var scanned time.Time
	every := min(rescan, p.cfg.Interval) // how often the list is read
	for {
		now := time.Now()
		if now.Sub(scanned) >= every {
			vols, scanned = p.cfg.Source.Volumes(), now
		}
		var run []Volume
		next := scanned.Add(every)
		p.mu.Lock()
		seen := map[Key]bool{}
		for _, v := range vols {
			k := Key{v.Plugin, v.ID}
			seen[k] = true
			d, ok := p.due[k]
			if !ok {
				d = p.slot(k, now)
				p.due[k] = d
			}
			if !d.After(now) && !p.busy[k] {
				p.busy[k] = true
				p.due[k] = d.Add(p.cfg.Interval * (now.Sub(d)/p.cfg.Interval + 1))
				run = append(run, v)
				d = p.due[k]
			}
			if d.After(now) && d.Before(next) {
				next = d // a busy volume past due waits for the next rescan
			}
		}
		for k := range p.due {
			if !seen[k] {
				delete(p.due, k)
			}
		}
		// A result of a volume no longer listed goes too, unless newer
		// than the list: a poll that ended after its volume went, or a
		// Refresh of a volume the next scan lists.
		for k, s := range p.last {
			if !seen[k] && !p.busy[k] && s.At.Before(scanned) {
				delete(p.last, k)
			}
		}
		p.mu.Unlock()
		for _, v := range run {
			wg.Add(1)
			go func() {
				defer wg.Done()
				p.poll(ctx, v)
			}()
		}
		t := time.NewTimer(max(time.Until(next), min(maxTick, p.cfg.Interval/60)))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// poll polls one volume within the concurrency cap and keeps the result.
func (p *Poller) poll(ctx context.Context, v Volume) Stats {
	k := Key{v.Plugin, v.ID}
	defer func() {
		p.mu.Lock()
		delete(p.busy, k)
		p.mu.Unlock()
	}()
	select {
	case p.sem <- struct{}{}:
	case <-ctx.Done():
		return Stats{At: time.Now(), Err: ctx.Err()}
	}
	defer func() { <-p.sem }()
	cctx, cancel := context.WithTimeout(ctx, p.cfg.CallTimeout)
	s := p.cfg.Source.Poll(cctx, v)
	cancel()
	if s.At.IsZero() {
		s.At = time.Now()
	}
	if s.Err != nil {
		p.cfg.Logger.Debug("volume stats failed", "plugin", v.Plugin, "volume", v.ID, "error", s.Err)
	}
	if s.Abnormal {
		p.cfg.Logger.Warn("volume abnormal", "plugin", v.Plugin, "volume", v.ID, "condition", s.Condition)
	}
	p.mu.Lock()
	if _, tracked := p.due[k]; tracked || ctx.Err() == nil {
		p.last[k] = s
	}
	p.mu.Unlock()
	return s
}

// Refresh polls the given volumes now (within the cap) and returns when
// all are done or ctx ends.
func (p *Poller) Refresh(ctx context.Context, vols []Volume) {
	var wg sync.WaitGroup
	for _, v := range vols {
		k := Key{v.Plugin, v.ID}
		p.mu.Lock()
		busy := p.busy[k]
		p.busy[k] = true
		p.mu.Unlock()
		if busy {
			continue // a poll is running: its result is as fresh
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.poll(ctx, v)
		}()
	}
	wg.Wait()
}

// Get returns a volume's last result.
func (p *Poller) Get(plugin, id string) (Stats, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	s, ok := p.last[Key{plugin, id}]
	return s, ok
}

// Snapshot returns every kept result.
func (p *Poller) Snapshot() map[Key]Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[Key]Stats, len(p.last))
	for k, s := range p.last {
		out[k] = s
	}
	return out
}
