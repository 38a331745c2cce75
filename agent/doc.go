// Package agent will be the csiagent daemon: it turns the plugin set that
// pluginconfig.Watch reports into running, healthy plugins (supervising
// managed plugin processes, connecting to unmanaged ones), serves the agent
// API on a unix socket, schedules reclaim-space calls and exports metrics.
//
// It holds no volume logic (that is package isolator) and no mount code
// (package mount). Nothing is implemented here yet; see issue 4.
package agent
