%% Compressed batches (`compress' setting, protocol version 4) between this node
%% and a peer: delivered complete and in order per sender and counted; never
%% sent to a peer at an older protocol version; switched on and off at run time
%% without loss, reordering or a wrong count; under `auto', what waits behind a
%% busy connection is measured and tried compressed, delivered and counted as
%% ever; and a compressed batch that does not decode is refused and counted by
%% the receiving inbox, which carries on.
-module(convoy_compress_SUITE).

-include_lib("common_test/include/ct.hrl").
-include_lib("stdlib/include/assert.hrl").

-export([all/0, suite/0, init_per_testcase/2, end_per_testcase/2]).
-export([compressed_in_order/1, old_peer_gets_plain/1, switched_while_streaming/1,
         auto_behind_busy_connection/1, corrupt_zbatch_rejected/1]).
%% Run on peer nodes.
-export([zbatch_tracer/1, stream_from/2, stream_behind_blocker/3]).

-define(SENDERS, 4).
-define(RECEIVERS, 4).
-define(MESSAGES, 20000).

suite() ->
    [{timetrap, {minutes, 3}}].

all() ->
    [compressed_in_order, old_peer_gets_plain, switched_while_streaming,
     auto_behind_busy_connection, corrupt_zbatch_rejected].

init_per_testcase(_TC, Config) ->
    _ = application:stop(convoy),
    Config.

end_per_testcase(_TC, _Config) ->
    _ = whereis(telemetry_sink) =:= undefined orelse unregister(telemetry_sink),
    convoy_ct_peers:stop_local().

%%--------------------------------------------------------------------
%% Test cases

%% Both sides at level 6: 20,000 event-shaped messages from 4 senders to 4
%% receivers arrive complete and in order per sender; this node counted
%% compressed batches to the peer, smaller than their messages, and reported
%% them by telemetry.
compressed_in_order(_Config) ->
    convoy_ct_peers:start_local(#{compress => 6}),
    {_Peer, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(cz_b), #{compress => 6}),
    Events = telemetry_sink(),
    Before = node_counts(B),
    ok = stream(B, fun(_) -> ok end),
    #{compressed_batches := Z, compressed_bytes_in := In, compressed_bytes_out := Out} =
        delta(Before, node_counts(B)),
    ct:pal("~b compressed batches, ~b bytes in, ~b out", [Z, In, Out]),
    ?assert(Z > 0),
    ?assert(Out < In),
    [{Entries, EvIn, EvOut} | _] = compressed_events(Events),
    ?assert(Entries >= 2 andalso EvOut < EvIn andalso EvIn >= convoy_compress:min_bytes()).

%% A peer whose route says protocol version 3 (it really runs this release, its
%% route is rewritten as an older one's would be) gets plain batches only, and
%% everything.
old_peer_gets_plain(_Config) ->
    convoy_ct_peers:start_local(#{compress => 9}),
    {PeerB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(cz_old), #{compress => 9}),
    settle_hellos(PeerB, B),
    ok = convoy_ct_peers:route_as_version(B, 3),
    Tracer = peer:call(PeerB, ?MODULE, zbatch_tracer, [convoy_inbox_1]),
    Before = node_counts(B),
    ok = stream(B, fun(_) -> ok end),
    ?assertMatch({convoy, 3, _}, convoy_peers:route(B)),
    ?assertMatch(#{compressed_batches := 0, compressed_bytes_in := 0, compressed_bytes_out := 0},
                 delta(Before, node_counts(B))),
    {Plain, Compressed} = traced(Tracer),
    ct:pal("the peer's inbox took ~b batches, ~b compressed", [Plain, Compressed]),
    ?assert(Plain > 0),
    ?assertEqual(0, Compressed).

%% `compress' switched never -> 6 -> never -> 9 -> never between five phases of
%% 4 senders streaming (each phase delivered before the next setting): nothing
%% lost, nothing reordered across the switches, every message accepted was sent
%% (accepted = messages + dropped, none dropped), and batches were compressed in
%% the phases at a level and only there. Every message goes through the lane
%% (`bypass_after => never'), so each phase's traffic is batched under its setting.
switched_while_streaming(_Config) ->
    convoy_ct_peers:start_local(#{bypass_after => never}),
    {_Peer, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(cz_switch), #{}),
    Before = node_counts(B),
    Receivers = [convoy_ct_seq:start(B) || _ <- lists:seq(1, ?RECEIVERS)],
    Levels = [never, 6, never, 9, never],
    Per = ?MESSAGES div ?SENDERS div length(Levels),
    Self = self(),
    Senders = [spawn_link(fun() -> phases(I, Receivers, Per, 1, length(Levels), Self) end)
               || I <- lists:seq(1, ?SENDERS)],
    Compressed =
        [begin
             ok = convoy:set_config(#{compress => Level}),
             C0 = maps:get(compressed_batches, node_counts(B)),
             [S ! {go, P} || S <- Senders],
             [receive {phase_done, S, P} -> ok after 60000 -> ct:fail({sender_stuck, S, P}) end
              || S <- Senders],
             {Level, maps:get(compressed_batches, node_counts(B)) - C0}
         end || {P, Level} <- lists:zip(lists:seq(1, length(Levels)), Levels)],
    ct:pal("compressed batches per phase: ~p", [Compressed]),
    [?assertEqual({never, 0}, {L, N}) || {L, N} <- Compressed, L =:= never],
    [?assert(N > 0, {L, N}) || {L, N} <- Compressed, L =/= never],
    PerReceiver = ?MESSAGES div ?RECEIVERS,
    [?assertEqual({PerReceiver, []}, convoy_ct_seq:await(R, PerReceiver)) || R <- Receivers],
    Counts = convoy_ct_peers:await(
               fun() -> delta(Before, node_counts(B)) end,
               fun(#{accepted := A, messages := M, dropped := D}) -> A =:= M + D end, 10000),
    ?assertMatch(#{accepted := ?MESSAGES, dropped := 0}, Counts),
    ?assertMatch(#{buffered := 0, queued := 0}, node_counts(B)).

%% Sender I's phases P..Last: on `{go, P}' its messages of phase P (numbering
%% going on from the phase before), then flushed (delivered) before it says so.
phases(_I, _Receivers, _Per, P, Last, _Driver) when P > Last ->
    ok;
phases(I, Receivers, Per, P, Last, Driver) ->
    receive {go, P} -> ok end,
    send_events(I, Receivers, (P - 1) * Per, Per),
    ok = convoy:flush(),
    Driver ! {phase_done, self(), P},
    phases(I, Receivers, Per, P + 1, Last, Driver).

%% `compress => auto' on peer A streaming to peer B while A's connection to B is
%% busy: A first sends B 128 MiB with `!', so A's lane for B waits behind it,
%% and its batches after that first one carry a meter each. B's inbox answers the meters and
%% A's lane takes the answers (its state counts them for B); every message
%% arrives in order per sender, counted exactly: accepted = messages, nothing
%% dropped, nothing left. Whether the lots then go compressed depends on how fast
%% this host's nodes are (the meter's decisions are the property's and EUnit's
%% to check): the count is logged.
auto_behind_busy_connection(_Config) ->
    {PeerA, _A} = convoy_ct_peers:start(?MODULE, ?CT_PEER_NAME(cz_auto_a), #{}),
    ok = convoy_ct_peers:start_convoy(PeerA, #{compress => auto, bypass_after => never}),
    {PeerB, B} = convoy_ct_peers:start(?MODULE, ?CT_PEER_NAME(cz_auto_b), #{}),
    ok = convoy_ct_peers:start_convoy(PeerB, #{}),
    pong = peer:call(PeerA, net_adm, ping, [B]),
    convoy = convoy_ct_peers:await(fun() -> convoy_ct_peers:route_kind(
                                              peer:call(PeerA, convoy_peers, route, [B]))
                                   end, fun(K) -> K =:= convoy end, 10000),
    Receivers = [convoy_ct_seq:start(B) || _ <- lists:seq(1, ?RECEIVERS)],
    Sink = convoy_ct_peers:sink_on(B),
    Total = 5 * ?MESSAGES,
    ok = peer:call(PeerA, ?MODULE, stream_behind_blocker, [Sink, Receivers, Total], 120000),
    PerReceiver = Total div ?RECEIVERS,
    [?assertEqual({PerReceiver, []}, convoy_ct_seq:await(R, PerReceiver)) || R <- Receivers],
    Counts = convoy_ct_peers:await(
               fun() -> maps:get(B, maps:get(nodes, peer:call(PeerA, convoy, info, []))) end,
               fun(#{accepted := Ac, messages := M, dropped := D}) -> Ac =:= M + D end, 10000),
    ct:pal("A's counts for B: ~p", [Counts]),
    ?assertMatch(#{accepted := Total, messages := Total, dropped := 0, buffered := 0,
                   queued := 0}, Counts),
    [Lane] = [P || #{node := N, pid := P} <- maps:get(lanes, peer:call(PeerA, convoy, info, [])),
                   N =:= B],
    #{compress := #{B := #{answers := Answers}}} = peer:call(PeerA, sys, get_state, [Lane]),
    ct:pal("~b meters answered, ~b batches compressed",
           [Answers, maps:get(compressed_batches, Counts)]),
    ?assert(Answers > 0).

%% On a peer: the blocker is queued on the connection to Sink's node (a send
%% checks the buffer before it queues, so the first one goes in whole), and the
%% stream starts at once, from here, while the connection is still busy with it.
stream_behind_blocker(Sink, Receivers, Total) ->
    Self = self(),
    _ = spawn(fun() ->
                      Sink ! {blocker, binary:copy(<<1>>, 1 bsl 27)},
                      Self ! blocker_queued
              end),
    receive blocker_queued -> ok end,
    stream_from(Receivers, Total).

%% On a peer: 4 senders each send their share of Total event-shaped messages to
%% the receivers in turn, flush, and the call returns once all have.
stream_from(Receivers, Total) ->
    Per = Total div ?SENDERS,
    Self = self(),
    Senders = [spawn_link(fun() ->
                                  send_events(I, Receivers, Per),
                                  ok = convoy:flush(),
                                  Self ! {sent, self()}
                          end) || I <- lists:seq(1, ?SENDERS)],
    [receive {sent, S} -> ok end || S <- Senders],
    ok.

%% A compressed batch that is not zlib, and one that decodes to something other
%% than a list, sent by hand to the peer's inbox: both refused and counted
%% `bad_compressed' there, the inbox still the same process, and a send right
%% after is delivered.
corrupt_zbatch_rejected(_Config) ->
    convoy_ct_peers:start_local(#{compress => 6}),
    {PeerB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(cz_bad), #{compress => 6}),
    Inbox = peer:call(PeerB, erlang, whereis, [convoy_inbox_1]),
    Rejected = fun() -> maps:get(rejected, peer:call(PeerB, convoy, info, [])) end,
    #{bad_compressed := Bad0} = Before = Rejected(),
    {convoy_inbox_1, B} ! {'$convoy', 1, zbatch, node(), <<"not zlib">>},
    {convoy_inbox_1, B} ! {'$convoy', 1, zbatch, node(),
                           term_to_binary({not_a, list}, [{compressed, 6}])},
    Sink = convoy_ct_peers:sink_on(B),
    ok = convoy:send(Sink, after_bad),
    ?assertEqual([after_bad], convoy_ct_peers:received(Sink, 1)),
    After = convoy_ct_peers:await(Rejected, fun(#{bad_compressed := N}) -> N >= Bad0 + 2 end,
                                  10000),
    ?assertEqual(Before#{bad_compressed := Bad0 + 2}, After),
    ?assertEqual(Inbox, peer:call(PeerB, erlang, whereis, [convoy_inbox_1])).

%%--------------------------------------------------------------------
%% Helpers

%% 4 senders here, each sending ?MESSAGES div 4 event-shaped messages to the 4
%% receivers on Node in turn; While(FirstReceiver) runs meanwhile. Returns once
%% every receiver has all of its messages, each sender's in order.
stream(Node, While) ->
    Receivers = [convoy_ct_seq:start(Node) || _ <- lists:seq(1, ?RECEIVERS)],
    Per = ?MESSAGES div ?SENDERS,
    Self = self(),
    Senders = [spawn_link(fun() ->
                                  receive go -> ok end,
                                  send_events(I, Receivers, Per),
                                  ok = convoy:flush(),
                                  Self ! {sent, self()}
                          end) || I <- lists:seq(1, ?SENDERS)],
    [S ! go || S <- Senders],
    ok = While(hd(Receivers)),
    [receive {sent, S} -> ok after 60000 -> ct:fail({sender_stuck, S}) end || S <- Senders],
    PerReceiver = ?MESSAGES div ?RECEIVERS,
    [?assertEqual({PerReceiver, []}, convoy_ct_seq:await(R, PerReceiver)) || R <- Receivers],
    ok.

%% Message J of sender I goes to receiver J rem 4: each receiver gets each
%% sender's messages numbered 1, 2, ...
send_events(I, Receivers, Per) ->
    send_events(I, Receivers, 0, Per).

%% Messages From .. From + Per - 1 of sender I.
send_events(I, Receivers, From, Per) ->
    K = length(Receivers),
    lists:foreach(fun(J) ->
                          To = lists:nth(J rem K + 1, Receivers),
                          ok = convoy:send(To, convoy_ct_seq:event(I, J div K + 1))
                  end, lists:seq(From, From + Per - 1)).

node_counts(Node) ->
    maps:get(Node, maps:get(nodes, convoy:info())).

delta(Before, After) ->
    maps:map(fun(K, V) when is_integer(V) -> V - maps:get(K, Before, 0);
                (_K, V) -> V
             end, After).

%% The peer learnt this node too, and both convoy_peers have handled what they
%% had: no welcome still on its way will rewrite the route.
settle_hellos(PeerB, B) ->
    Here = node(),
    convoy_ct_peers:await(fun() -> peer:call(PeerB, convoy_peers, route, [Here]) end,
                          fun(R) -> convoy_ct_peers:route_kind(R) =:= convoy end, 10000),
    _ = peer:call(PeerB, sys, get_state, [convoy_peers]),
    _ = sys:get_state(convoy_peers),
    _ = peer:call(PeerB, sys, get_state, [convoy_peers]),
    _ = sys:get_state(convoy_peers),
    convoy = convoy_ct_peers:await_route(B, convoy),
    ok.

%% A process registered as telemetry_sink (test/telemetry.erl, a stand-in for
%% the library, sends it every event) that keeps the compressed batches' events.
telemetry_sink() ->
    {module, telemetry} = code:ensure_loaded(telemetry),
    Pid = spawn_link(fun() -> events([]) end),
    true = register(telemetry_sink, Pid),
    Pid.

events(Acc) ->
    receive
        {telemetry, [convoy, batch, compressed], #{entries := E, bytes_in := In,
                                                   bytes_out := Out}, #{node := _}} ->
            events([{E, In, Out} | Acc]);
        {telemetry, _, _, _} ->
            events(Acc);
        {get, From} ->
            From ! {events, lists:reverse(Acc)},
            events(Acc)
    end.

compressed_events(Sink) ->
    Sink ! {get, self()},
    receive {events, Events} -> Events after 5000 -> ct:fail(telemetry_sink_silent) end.

%% On a peer: counts the plain and the compressed batches the inbox Name takes.
zbatch_tracer(Name) ->
    Tracer = spawn(fun() -> tracer(0, 0) end),
    1 = erlang:trace(whereis(Name), true, ['receive', {tracer, Tracer}]),
    Tracer.

tracer(Plain, Compressed) ->
    receive
        {trace, _, 'receive', {'$convoy', _, batch, _, _}} -> tracer(Plain + 1, Compressed);
        {trace, _, 'receive', {'$convoy', _, zbatch, _, _}} -> tracer(Plain, Compressed + 1);
        {trace, _, 'receive', _} -> tracer(Plain, Compressed);
        {get, From} -> From ! {traced, Plain, Compressed}
    end.

traced(Tracer) ->
    Tracer ! {get, self()},
    receive {traced, Plain, Compressed} -> {Plain, Compressed}
    after 5000 -> ct:fail(tracer_silent)
    end.
