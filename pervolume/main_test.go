package pervolume_test

import (
	"testing"

	"go.uber.org/goleak"
)

// Every Run is stopped and every RunNow has returned when the tests end:
// no goroutine of the scheduler outlives them.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
