%% Experiment (not part of the harness): how close can `convoy:batch/1' come to
%% `convoy:send_many/1' for one sender's stream? Node A sends 1,000,000 messages
%% to one process on peer B, in scopes (or lists) of 1,000, and times the sender
%% (wall time per message, the sender is what limits `oneway' here).
%% Ways, interleaved in each repeat:
%%   send_many  the caller builds a list of {Pid, Msg} and calls convoy:send_many/1
%%              (the harness's `send_many' variant);
%%   batch      convoy:send/2 per message inside convoy:batch/1 (its `batch');
%%   bound      the least any scope kept in the process dictionary (the cheapest
%%              store a process can write per call) can cost: per call one get and
%%              one put of [{Pid, Msg} | Collected], nothing counted or checked,
%%              then convoy:send_many/1 of the collected list, reversed. No
%%              collection of calls made one by one can be cheaper than this.
%% Shapes: the atom `message' and the event tuple of the harness.
%%
%% Run from the repository, with the harness compiled (`rebar3 as bench compile'):
%%   erlc -o /tmp bench/experiments/batch_bound.erl
%%   erl -sname bb -noshell -pa _build/bench/lib/convoy/ebin -pa /tmp \
%%       -s batch_bound run -s init stop
-module(batch_bound).

-export([run/0]).
%% Run on the peer.
-export([sink/0]).

-define(REPEATS, 5).
-define(MESSAGES, 1000000).
-define(SCOPE, 1000).
-define(KEY, batch_bound_collected).

run() ->
    {ok, Peer, B} = peer:start_link(#{name => bb_b,
                                      args => ["-pa", filename:dirname(code:which(convoy)),
                                               "-pa", filename:dirname(code:which(?MODULE))]}),
    {ok, _} = application:ensure_all_started(convoy),
    {ok, _} = erpc:call(B, application, ensure_all_started, [convoy]),
    Sink = erpc:call(B, erlang, spawn, [?MODULE, sink, []]),
    ok = convoy:send(Sink, warm),
    timer:sleep(200),
    Ways = [send_many, batch, bound],
    [shape(Shape, Ways, Sink) || Shape <- [atom, event]],
    peer:stop(Peer),
    ok.

shape(Shape, Ways, Sink) ->
    Rows = [[{Way, ns_per_msg(Way, Shape, Sink)} || Way <- Ways] || _ <- lists:seq(1, ?REPEATS)],
    io:format("~s: sender's ns per message, median of ~b repeats (~b messages, scopes "
              "and lists of ~b)~n", [Shape, ?REPEATS, ?MESSAGES, ?SCOPE]),
    Medians = [{Way, median([proplists:get_value(Way, Row) || Row <- Rows])} || Way <- Ways],
    Base = proplists:get_value(send_many, Medians),
    [io:format("  ~-10s ~7.1f ns   x send_many msg/s ~.2f (per repeat: ~s)~n",
               [Way, Ns, Base / Ns,
                lists:join(" ", [io_lib:format("~.2f", [proplists:get_value(send_many, Row) /
                                                         proplists:get_value(Way, Row)])
                                 || Row <- Rows])])
     || {Way, Ns} <- Medians],
    ok.

median(L) -> lists:nth((length(L) + 1) div 2, lists:sort(L)).

ns_per_msg(Way, Shape, Sink) ->
    ok = settle(),
    T0 = erlang:monotonic_time(nanosecond),
    ok = scopes(Way, Shape, Sink, 1),
    (erlang:monotonic_time(nanosecond) - T0) / ?MESSAGES.

%% Nothing left from the way before: convoy holds nothing for the peer.
settle() ->
    Queued = lists:sum([maps:get(queued, C, 0) || C <- maps:values(maps:get(nodes, convoy:info()))]),
    case Queued of
        0 -> timer:sleep(50);
        _ -> timer:sleep(10), settle()
    end.

scopes(_Way, _Shape, _Sink, I) when I > ?MESSAGES ->
    ok;
scopes(Way, Shape, Sink, I) ->
    Last = I + ?SCOPE - 1,
    ok = scope(Way, Shape, Sink, I, Last),
    scopes(Way, Shape, Sink, Last + 1).

scope(send_many, Shape, Sink, I, Last) ->
    convoy:send_many(list(Shape, Sink, I, Last, []));
scope(batch, Shape, Sink, I, Last) ->
    convoy:batch(fun() -> sends(Shape, Sink, I, Last) end);
scope(bound, Shape, Sink, I, Last) ->
    put(?KEY, []),
    collect(Shape, Sink, I, Last),
    convoy:send_many(lists:reverse(erase(?KEY))).

list(_Shape, _Sink, I, Last, Acc) when I > Last -> lists:reverse(Acc);
list(Shape, Sink, I, Last, Acc) -> list(Shape, Sink, I + 1, Last, [{Sink, msg(Shape, I)} | Acc]).

sends(_Shape, _Sink, I, Last) when I > Last -> ok;
sends(Shape, Sink, I, Last) -> ok = convoy:send(Sink, msg(Shape, I)), sends(Shape, Sink, I + 1, Last).

collect(_Shape, _Sink, I, Last) when I > Last -> ok;
collect(Shape, Sink, I, Last) ->
    put(?KEY, [{Sink, msg(Shape, I)} | get(?KEY)]),
    collect(Shape, Sink, I + 1, Last).

-compile({inline, [msg/2]}).
msg(atom, _I) -> message;
msg(event, I) -> {event, I, <<"user-42">>, #{k => I}}.

%% @doc The receiver on the peer.
-spec sink() -> no_return().
sink() ->
    receive _ -> sink() end.
