%% Bounds that more than one module enforces, each written once here.

%% The most lanes (`lanes' setting, convoy_config) and so the most inboxes a node
%% runs (one per lane at start): a peer's hello may claim 1 to this many
%% (convoy_wire), which bounds the inbox names it makes this node create.
-define(MAX_LANES, 1024).

%% The largest `chunk_window' (convoy_config). A sender asks for an answer every
%% `chunk_window div 2' pieces; a start piece may ask for at most this many
%% (convoy_wire).
-define(MAX_CHUNK_WINDOW, 1024).

%% The largest `block_timeout' (convoy_config), ms: the longest one send waits
%% for room. convoy_gen waits for a call's room in steps of at most this.
-define(MAX_BLOCK_MS, 3600000).

%% The largest timeout a `receive ... after' takes, ms (a channel's `timeout',
%% convoy_config; a call's, convoy_gen).
-define(MAX_RECEIVE_MS, 16#FFFFFFFF).

%% How many tuples deep a message's largest binary may sit to travel on its own
%% beside the rest (convoy_chunk looks that deep; convoy_wire accepts a path of
%% 1 to this many indices).
-define(PATH_DEPTH, 3).
