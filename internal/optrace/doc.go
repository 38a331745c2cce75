// Package optrace records where one operation's time goes: a Trace,
// carried in a context.Context (With), collects timed events (Begin) that
// the code on the operation's path opens and closes at its choke points
// (lock waits, durability waits, plugin calls, mount work, cluster
// claims), and counters (Add), and renders them as a table (String): one
// line per event in time order, then per kind the events' count and total,
// and the wall time no event covers.
//
// It is a measuring tool, off unless asked for: code given a context
// without a Trace pays one context lookup per Begin and allocates nothing.
// Events may be opened and closed on any goroutine.
package optrace
