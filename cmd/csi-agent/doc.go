// Command csi-agent is the csiagent daemon and its command line.
package main
