%% Order across path switches after a message in pieces whose delivery was not
%% confirmed: a `lanes' change and a stop of convoy. The peer's inbox that
%% reassembles the message is suspended (sys:suspend) so that the sender's wait
%% for the delivery runs out (`sent'); the sender's next message must still
%% arrive after it.
-module(convoy_switch_SUITE).

-include_lib("common_test/include/ct.hrl").
-include_lib("stdlib/include/assert.hrl").
-include("../src/convoy_runtime.hrl").

-export([all/0, init_per_testcase/2, end_per_testcase/2]).
-export([lanes_change_after_unconfirmed_pieces/1, stop_after_unconfirmed_pieces/1,
         restart_after_unconfirmed_pieces/1, lanes_change_after_pieces_then_lane/1,
         stop_after_pieces_then_lane/1]).
%% Run on peer nodes.
-export([collector/0]).

%% A message of one piece (large, cut in pieces, one of them), so that the
%% sender's only wait is for its delivery.
-define(SETTINGS, #{large_threshold => 1000, chunk_threshold => 2000, chunk_guard => always,
                    lanes => 2}).

all() ->
    [lanes_change_after_unconfirmed_pieces, stop_after_unconfirmed_pieces,
     restart_after_unconfirmed_pieces, lanes_change_after_pieces_then_lane,
     stop_after_pieces_then_lane].

init_per_testcase(_TC, Config) ->
    _ = application:stop(convoy),
    Config.

end_per_testcase(_TC, _Config) ->
    convoy_ct_peers:stop_local().

%% lanes 2 -> 1: the sender's lane (2) shipped to the peer's second inbox, its
%% new one ships to the first.
lanes_change_after_unconfirmed_pieces(_Config) ->
    switch_after_pieces(fun() -> ok = convoy:set_config(#{lanes => 1}) end).

%% convoy stops: the sender's next message is a plain send.
stop_after_unconfirmed_pieces(_Config) ->
    switch_after_pieces(fun() -> ok = application:stop(convoy) end).

%% convoy stops and starts with one lane.
restart_after_unconfirmed_pieces(_Config) ->
    switch_after_pieces(fun() ->
                                ok = application:stop(convoy),
                                ok = application:set_env(convoy, lanes, 1),
                                {ok, _} = application:ensure_all_started(convoy)
                        end).

switch_after_pieces(Switch) ->
    start_convoy(?SETTINGS),
    {PeerB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(switch_b), #{lanes => 2}),
    Sink = spawn(B, ?MODULE, collector, []),
    {convoy, _, Inboxes} = convoy_peers:route(B),
    Inbox = convoy_wire:lane_inbox(2, Inboxes),
    ?assertNotEqual(Inbox, convoy_wire:lane_inbox(1, Inboxes)),
    Sender = sender_on_lane(2, Sink),
    ok = peer:call(PeerB, sys, suspend, [Inbox]),
    try
        Sender ! {send, large, binary:copy(<<"L">>, 10000)},
        receive {sent, Sender} -> ok after 10000 -> ct:fail(large_not_sent) end,
        ?assert(is_unconfirmed(Sender, B)),
        %% the wait for the delivery that ran out is counted as a barrier's is
        #{stalled := Stalled, waited_us := WaitedUs} = maps:get(B, maps:get(nodes, convoy:info())),
        ?assert(Stalled >= 1),
        ?assert(WaitedUs >= 90000),
        Switch(),
        Sender ! {send, small, small},
        receive {sent, Sender} -> ok after 10000 -> ct:fail(small_not_sent) end,
        %% nothing may be delivered before the message in pieces
        ?assertEqual([], received(Sink))
    after
        peer:call(PeerB, sys, resume, [Inbox])
    end,
    await_received(Sink, [large, small]),
    %% and once the inbox answers, the next message goes its usual way, behind them
    Sender ! {send, after_resume, x},
    receive {sent, Sender} -> ok after 10000 -> ct:fail(third_not_sent) end,
    await_received(Sink, [large, small, after_resume]).

%% After the unconfirmed message in pieces, the sender's next message goes to
%% its lane, which has not shipped it yet (the lane is suspended here, as a lane
%% waiting out a busy connection or the node's bound would be); then `lanes'
%% changes (2 -> 1). The message after that must not overtake the one in the old
%% lane: it waits behind it (the new lane holds the node until the old lane has
%% shipped and confirmed it), never goes to the old inbox ahead of it.
lanes_change_after_pieces_then_lane(_Config) ->
    pieces_then_lane(fun() -> ok = convoy:set_config(#{lanes => 1}) end, fun() -> ok end).

%% The same with a stop of convoy instead of a lanes change: the message after
%% it is a plain send, which must wait until the lane is gone.
stop_after_pieces_then_lane(_Config) ->
    Self = self(),
    pieces_then_lane(fun() ->
                             spawn(fun() -> Self ! {stopped, application:stop(convoy)} end),
                             convoy_ct_peers:await(fun() -> stopping() end, fun(S) -> S end, 10000)
                     end,
                     fun() -> receive {stopped, ok} -> ok after 20000 -> ct:fail(no_stop) end end).

pieces_then_lane(Switch, AfterResume) ->
    start_convoy(?SETTINGS),
    {PeerB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(switch_lane), #{lanes => 2}),
    Sink = spawn(B, ?MODULE, collector, []),
    {convoy, _, Inboxes} = convoy_peers:route(B),
    Inbox = convoy_wire:lane_inbox(2, Inboxes),
    Sender = sender_on_lane(2, Sink),
    Lane = convoy_ct_peers:lane(B, 2),
    ok = peer:call(PeerB, sys, suspend, [Inbox]),
    try
        Sender ! {send, large, binary:copy(<<"L">>, 10000)},
        receive {sent, Sender} -> ok after 10000 -> ct:fail(large_not_sent) end,
        ?assert(is_unconfirmed(Sender, B)),
        ok = sys:suspend(Lane),
        try
            Sender ! {send, in_lane, x},
            receive {sent, Sender} -> ok after 10000 -> ct:fail(in_lane_not_sent) end,
            Switch(),
            Sender ! {send, after_switch, y},
            %% the sender may wait (for the old lane) until both are resumed
            receive {sent, Sender} -> ok after 200 -> ok end
        after
            sys:resume(Lane)
        end
    after
        peer:call(PeerB, sys, resume, [Inbox])
    end,
    AfterResume(),
    await_received(Sink, [large, in_lane, after_switch]).

stopping() ->
    case persistent_term:get(?RUNTIME_KEY, undefined) of
        #runtime{stopping = Stopping} -> Stopping;
        undefined -> true
    end.

%% A process whose lane (of 2) is Lane, sending to Sink as told.
sender_on_lane(Lane, Sink) ->
    Self = self(),
    Pid = spawn_link(fun() -> sender_loop(Self, Sink) end),
    case erlang:phash2(Pid, 2) + 1 of
        Lane -> Pid;
        _ -> unlink(Pid), exit(Pid, kill), sender_on_lane(Lane, Sink)
    end.

sender_loop(Parent, Sink) ->
    receive
        {send, Tag, Payload} ->
            ok = convoy:send(Sink, {Tag, Payload}),
            Parent ! {sent, self()},
            sender_loop(Parent, Sink);
        {is_marked, Node, ReplyTo} ->
            ReplyTo ! {is_marked, self(), convoy_sender:is_marked(Node)},
            sender_loop(Parent, Sink)
    end.

%% The sender stays marked: its wait for the delivery ran out.
is_unconfirmed(Sender, Node) ->
    Sender ! {is_marked, Node, self()},
    receive {is_marked, Sender, M} -> M after 5000 -> ct:fail(no_answer) end.

start_convoy(Settings) ->
    convoy_ct_peers:start_local(Settings).

collector() ->
    collector([]).

collector(Got) ->
    receive
        {report, ReplyTo} -> ReplyTo ! {report, self(), lists:reverse(Got)}, collector(Got);
        {Tag, _Payload} -> collector([Tag | Got])
    end.

received(Sink) ->
    Sink ! {report, self()},
    receive {report, Sink, Got} -> Got after 10000 -> ct:fail(no_report) end.

await_received(Sink, Expected) ->
    Got = convoy_ct_peers:await(fun() -> received(Sink) end,
                                fun(G) -> length(G) >= length(Expected) end, 10000),
    ?assertEqual(Expected, Got).
