package retrypolicy

import (
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

func TestParse(t *testing.T) {
	ms := func(n int) *durationpb.Duration { return durationpb.New(time.Duration(n) * time.Millisecond) }
	for _, c := range []struct {
		name string
		in   *agentv1.RetryPolicy
		want Policy
		err  string
	}{
		{"defaults", nil, Policy{DefaultAttempts, DefaultBackoff, DefaultMaxBackoff, DefaultTimeout}, ""},
		{"set", &agentv1.RetryPolicy{MaxAttempts: 3, InitialBackoff: ms(20), MaxBackoff: ms(40), Timeout: ms(1000)},
			Policy{3, 20 * time.Millisecond, 40 * time.Millisecond, time.Second}, ""},
		{"max below initial is raised", &agentv1.RetryPolicy{InitialBackoff: ms(900), MaxBackoff: ms(100)},
			Policy{DefaultAttempts, 900 * time.Millisecond, 900 * time.Millisecond, DefaultTimeout}, ""},
		{"too many attempts", &agentv1.RetryPolicy{MaxAttempts: MaxAttempts + 1}, Policy{}, "retry.max_attempts 101: at most 100"},
		{"backoff too short", &agentv1.RetryPolicy{InitialBackoff: ms(1)}, Policy{}, "retry.initial_backoff 1ms: must be between"},
		{"invalid duration", &agentv1.RetryPolicy{Timeout: &durationpb.Duration{Seconds: 1, Nanos: -1}}, Policy{}, "retry.timeout"},
	} {
		got, err := Parse(c.in)
		switch {
		case c.err != "" && (err == nil || !strings.Contains(err.Error(), c.err)):
			t.Errorf("%s: error %v, want one with %q", c.name, err, c.err)
		case c.err == "" && err != nil:
			t.Errorf("%s: %v", c.name, err)
		case c.err == "" && got != c.want:
			t.Errorf("%s: %+v, want %+v", c.name, got, c.want)
		}
	}
}

func TestBackoffDoublesToMaxWithJitter(t *testing.T) {
	p := Policy{Initial: 100 * time.Millisecond, Max: 400 * time.Millisecond}
	for n, base := range map[int]time.Duration{1: 100, 2: 200, 3: 400, 4: 400, 40: 400} {
		base *= time.Millisecond
		for range 20 {
			if d := p.Backoff(n); d < base || d > base+base/10 {
				t.Fatalf("backoff(%d) = %v, want %v plus at most 10%%", n, d, base)
			}
		}
	}
}
