%% A PropEr stateful property of convoy_channel, run from EUnit (there is no
%% rebar3 PropEr plugin here).
%%
%% The test process is the producer. Its consumer is a test process that processes
%% (receives, checks and acks) channel messages only when told to, so the property
%% decides when credit comes back. Random sequences of sends, acks of k messages,
%% churns (the consumer acks one message each of k channels that are then gone,
%% leaving k partial ack counts), consumer deaths (`exit(C, kill)'), `info/1'
%% calls and restarts (close, new consumer, new channel with a random window and
%% ack_every) run against a model that tracks sent, acked, credit returned and not
%% yet read, in flight, and what the consumer holds, including its partial ack
%% counts and their sweeps (see convoy_channel's module doc): the live channel's
%% count, marked or not, the counts of gone channels, marked or not, and the room
%% left before the next sweep. Sends use `timeout => 0', so a send that would wait
%% returns `{error, timeout}' at once and the model knows which.
%%
%% After every command:
%% <ul>
%% <li>the result is the model's: `ok', `{error, timeout}' exactly when the window
%%   is spent and no credit came back, `{error, {consumer_down, killed}}' once the
%%   producer has seen the death (when its credit runs out, or in `info/1');</li>
%% <li>the consumer never holds more than `window' messages; `info/1' reports the
%%   model's credit and in flight, and in flight never exceeds the window;</li>
%% <li>the consumer processes exactly 1, 2, 3, ... of its channel, in order;</li>
%% <li>after every ack and churn the consumer holds exactly the model's partial ack
%%   counts and room: the counts of gone channels never outnumber two sweeps'
%%   worth, and a live count swept is credit the producer gets.</li>
%% </ul>
%% At the end: every message a send answered `ok' was either received by a consumer
%% (processed, or still in its mailbox) or lost to its death (in its mailbox when
%% it was killed, or sent before the producer saw the death):
%% delivered + lost_to_death = sent_ok.
-module(prop_convoy_channel_tests).

-behaviour(proper_statem).

-include_lib("proper/include/proper.hrl").
-include_lib("eunit/include/eunit.hrl").

-export([prop_channel/0]).
-export([initial_state/0, command/1, precondition/2, postcondition/3, next_state/3]).
-export([restart/2, send/0, ack/1, churn/1, kill/0, info/0]).

%% convoy_channel's ACK_ROOM: partial ack counts a consumer may start between two
%% sweeps.
-define(ACK_ROOM, 1024).

%%--------------------------------------------------------------------
%% EUnit wrapper

channel_test_() ->
    {timeout, 120,
     ?_assertEqual(ok, convoy_prop:check(prop_channel(),
                                         [{numtests, 500}, {to_file, user}, {max_shrinks, 200}]))}.

%%--------------------------------------------------------------------
%% The property

prop_channel() ->
    ?FORALL(Cmds, more_commands(3, proper_statem:commands(?MODULE)),
            begin
                Outcome = try proper_statem:run_commands(?MODULE, Cmds) of
                              {H, S, R} -> {H, S, R, final_check()}
                          catch
                              C:E:St -> {exception, C, E, St}
                          end,
                cleanup(),
                ?WHENFAIL(io:format(user, "Commands ~p~nOutcome ~p~n", [Cmds, Outcome]),
                          case Outcome of
                              {_, _, ok, ok} -> true;
                              _ -> false
                          end)
            end).

%%--------------------------------------------------------------------
%% Model

initial_state() ->
    #{state => none, w => 0, a => 0, credit => 0, pending => 0, unreturned => 0,
      queue => 0, alive => false, marked => false, dead_new => 0, dead_old => 0,
      room => ?ACK_ROOM}.

command(#{state := none}) ->
    restart_cmd();
command(#{alive := Alive, unreturned := U}) ->
    %% Churns are likelier while the live channel has a partial count to sweep.
    Churn = case U of 0 -> 2; _ -> 8 end,
    frequency([{12, {call, ?MODULE, send, []}},
               {2, restart_cmd()},
               {3, {call, ?MODULE, info, []}}]
              ++ [{5, {call, ?MODULE, ack, [choose(1, 10)]}} || Alive]
              ++ [{Churn, {call, ?MODULE, churn, [churn_size()]}} || Alive]
              ++ [{1, {call, ?MODULE, kill, []}} || Alive]).

%% Mostly about a room's worth: a sweep per churn or so.
churn_size() ->
    frequency([{1, choose(1, 10)}, {4, choose(?ACK_ROOM - 10, ?ACK_ROOM + 10)}]).

restart_cmd() ->
    ?LET(W, choose(1, 8), {call, ?MODULE, restart, [W, choose(1, W)]}).

precondition(#{state := none}, {call, _, F, _}) -> F =:= restart;
precondition(#{alive := Alive}, {call, _, F, _}) when F =:= ack; F =:= churn; F =:= kill ->
    Alive;
precondition(_, _) -> true.

next_state(S, _Res, {call, _, restart, [W, A]}) ->
    S#{state := open, w := W, a := A, credit := W, pending := 0, unreturned := 0,
       queue := 0, alive := true, marked := false, dead_new := 0, dead_old := 0,
       room := ?ACK_ROOM};
next_state(S, _Res, {call, _, send, []}) ->
    element(2, model_send(S));
next_state(S, _Res, {call, _, ack, [K]}) ->
    model_acks(S, K);
next_state(S, _Res, {call, _, churn, [K]}) ->
    model_churn(S, K);
next_state(S, _Res, {call, _, kill, []}) ->
    S#{queue := 0, alive := false, unreturned := 0};
next_state(S, _Res, {call, _, info, []}) ->
    model_collect(S).

%% The consumer processes min(K, queue) messages, acking each.
model_acks(S = #{queue := Q}, K) ->
    N = min(K, Q),
    lists:foldl(fun(_, Acc) -> model_ack(Acc) end, S#{queue := Q - N}, lists:seq(1, N)).

%% One ack of the live channel, counted as convoy_channel:ack/1 does: with
%% ack_every 1 credit goes back at once; otherwise a count is started (taking
%% room), continued (unmarked if marked) or completed (credit sent, room given
%% back).
model_ack(S = #{a := 1, pending := P}) ->
    S#{pending := P + 1};
model_ack(S = #{unreturned := 0}) ->
    started(S#{unreturned := 1, marked := false});
model_ack(S = #{unreturned := U, a := A, pending := P, room := R}) when U + 1 >= A ->
    S#{unreturned := 0, marked := false, pending := P + A, room := R + 1};
model_ack(S = #{unreturned := U}) ->
    S#{unreturned := U + 1, marked := false}.

%% K channels that are gone leave a count each.
model_churn(S, 0) ->
    S;
model_churn(S = #{dead_new := D}, K) ->
    model_churn(started(S#{dead_new := D + 1}), K - 1).

%% A count started takes a unit of room; the last unit sweeps.
started(S = #{room := R}) when R > 1 ->
    S#{room := R - 1};
started(S) ->
    sweep(S).

%% Counts marked by the last sweep and not acked since are returned as credit (to
%% a dead alias for gone channels), the others marked.
sweep(S = #{unreturned := U, marked := Marked, pending := P, dead_new := D}) ->
    S1 = S#{dead_new := 0, dead_old := D, room := ?ACK_ROOM},
    case U > 0 of
        true when Marked -> S1#{unreturned := 0, marked := false, pending := P + U};
        true -> S1#{marked := true};
        false -> S1
    end.

%% The consumer's partial ack counts and room, as it reports them.
model_counts(#{unreturned := U, dead_new := DN, dead_old := DO, room := R}) ->
    {DN + DO + min(U, 1), R}.

%% What the producer does when its credit is spent: take the credits waiting, then
%% the DOWN behind them.
model_collect(S = #{state := open, credit := C, pending := P, alive := Alive}) ->
    S1 = S#{credit := C + P, pending := 0},
    case Alive of
        true -> S1;
        false -> S1#{state := down}
    end;
model_collect(S) ->
    S.

%% {Expected result, next state}
model_send(S = #{state := down}) ->
    {{error, {consumer_down, killed}}, S};
model_send(S = #{credit := C}) when C > 0 ->
    {ok, sent(S)};
model_send(S) ->
    case model_collect(S) of
        S1 = #{state := down} -> {{error, {consumer_down, killed}}, S1};
        S1 = #{credit := C} when C > 0 -> {ok, sent(S1)};
        S1 -> {{error, timeout}, S1}
    end.

sent(S = #{credit := C, alive := true, queue := Q}) -> S#{credit := C - 1, queue := Q + 1};
sent(S = #{credit := C, alive := false}) -> S#{credit := C - 1}.

postcondition(_S, {call, _, restart, _}, Res) ->
    Res =:= ok;
postcondition(S = #{w := W}, {call, _, send, []}, {Res, QLen}) ->
    {Expected, _} = model_send(S),
    Res =:= Expected andalso QLen =< W;
postcondition(S = #{queue := Q}, {call, _, ack, [K]}, Res) ->
    Res =:= {processed, min(K, Q), in_order, model_counts(model_acks(S, K))};
postcondition(S, {call, _, churn, [K]}, Res) ->
    Res =:= {churned, model_counts(model_churn(S, K))};
postcondition(#{queue := Q}, {call, _, kill, []}, Res) ->
    Res =:= {killed, Q};
postcondition(S = #{w := W}, {call, _, info, []}, Res) ->
    #{state := St, credit := C} = model_collect(S),
    Expected = case St of
                   open -> #{state => open, credit => C, in_flight => W - C};
                   down -> #{state => down, credit => 0, in_flight => W - C}
               end,
    maps:with([state, credit, in_flight], Res) =:= Expected
        andalso maps:get(in_flight, Res) =< W andalso maps:get(window, Res) =:= W;
postcondition(_, _, _) ->
    false.

%%--------------------------------------------------------------------
%% Commands, run in the test process (the producer). They never raise: PropEr 1.2
%% would call erlang:get_stacktrace/0, which OTP 25 no longer has.

-define(GUARD(Body), try Body catch C:E:St -> {crashed, C, E, St} end).

restart(W, A) ->
    ?GUARD(begin
               stop_current(),
               Consumer = spawn(fun() -> consumer(1) end),
               {ok, Ch} = convoy_channel:open(Consumer, #{window => W, ack_every => A,
                                                          timeout => 0}),
               put(prop_channel, {Ch, Consumer}),
               put(prop_alive, true),
               ok
           end).

send() ->
    ?GUARD(begin
               {Ch, Consumer} = get(prop_channel),
               Seq = bump(prop_seq),
               Res = convoy_channel:send(Ch, {seq, Seq}),
               case Res of
                   ok ->
                       _ = bump(prop_sent_ok),
                       get(prop_alive) orelse bump(prop_lost);
                   _ ->
                       %% Not sent: the next send carries the same number.
                       put(prop_seq, Seq - 1)
               end,
               {Res, queue_len(Consumer)}
           end).

ack(K) ->
    ?GUARD(begin
               {_, Consumer} = get(prop_channel),
               Consumer ! {process, K, self()},
               receive
                   {processed, Consumer, N, Verdict, Counts} ->
                       _ = bump(prop_processed, N),
                       {processed, N, Verdict, Counts}
               end
           end).

churn(K) ->
    ?GUARD(begin
               {_, Consumer} = get(prop_channel),
               Consumer ! {churn, K, self()},
               receive {churned, Consumer, Counts} -> {churned, Counts} end
           end).

kill() ->
    ?GUARD(begin
               {Ch, Consumer} = get(prop_channel),
               %% The consumer is idle in its receive: its queue is channel messages.
               Q = queue_len(Consumer),
               Mon = monitor(process, Consumer),
               exit(Consumer, kill),
               receive {'DOWN', Mon, process, Consumer, killed} -> ok end,
               ok = await_channel_down(element(3, Ch)),
               put(prop_alive, false),
               _ = bump(prop_lost, Q),
               {killed, Q}
           end).

info() ->
    ?GUARD(begin
               {Ch, _} = get(prop_channel),
               convoy_channel:info(Ch)
           end).

%%--------------------------------------------------------------------
%% The consumer: processes up to K waiting channel messages when told to, checking
%% that they are 1, 2, 3, ... in order.

consumer(Next) ->
    receive
        {process, K, From} ->
            {N, Next1, Verdict} = process(K, 0, Next, in_order),
            From ! {processed, self(), N, Verdict, counts()},
            consumer(Next1);
        {churn, K, From} ->
            ok = gone_channels(K),
            From ! {churned, self(), counts()},
            consumer(Next)
    end.

%% K channels to the consumer itself, each closed once its one message is here,
%% that message acked after the close (ack_every 2: a partial count each).
gone_channels(0) ->
    ok;
gone_channels(K) ->
    {ok, Ch} = convoy_channel:open(self(), #{window => 2, ack_every => 2}),
    ok = convoy_channel:send(Ch, gone),
    Token = receive {convoy_channel, T, gone} -> T end,
    ok = convoy_channel:close(Ch),
    ok = convoy_channel:ack(Token),
    gone_channels(K - 1).

%% How many partial ack counts the consumer holds, and its room (none until its
%% first count: a whole room).
counts() ->
    Room = case get('$convoy_ack_room') of
               undefined -> ?ACK_ROOM;
               R -> R
           end,
    {length([K || {{'$convoy_ack', _} = K, _} <- get()]), Room}.

process(0, N, Next, Verdict) ->
    {N, Next, Verdict};
process(K, N, Next, Verdict) ->
    case convoy_channel:recv(0) of
        {ok, Token, {seq, Next}} ->
            ok = convoy_channel:ack(Token),
            process(K - 1, N + 1, Next + 1, Verdict);
        {ok, Token, {seq, Other}} ->
            ok = convoy_channel:ack(Token),
            process(K - 1, N + 1, Other + 1, {out_of_order, Next, Other});
        timeout ->
            {N, Next, Verdict}
    end.

%%--------------------------------------------------------------------
%% Helpers

queue_len(Pid) ->
    case process_info(Pid, message_queue_len) of
        {message_queue_len, Q} -> Q;
        undefined -> 0
    end.

bump(Key) -> bump(Key, 1).

bump(Key, N) ->
    V = case get(Key) of undefined -> N; Old -> Old + N end,
    put(Key, V),
    V.

%% The consumer's DOWN to the channel's monitor and to ours are two signals sent
%% as the consumer exits: ours can come first. Wait until the channel's is here.
await_channel_down(Mon) ->
    {messages, Ms} = process_info(self(), messages),
    case [x || {'DOWN', R, process, _, _} <- Ms, R =:= Mon] of
        [] -> erlang:yield(), await_channel_down(Mon);
        _ -> ok
    end.

%% Close the channel; what the old consumer still holds counts as delivered.
stop_current() ->
    case get(prop_channel) of
        undefined ->
            ok;
        {Ch, Consumer} ->
            ok = convoy_channel:close(Ch),
            case get(prop_alive) of
                true ->
                    _ = bump(prop_held, queue_len(Consumer)),
                    exit(Consumer, kill);
                _ ->
                    ok
            end,
            put(prop_seq, 0),
            erase(prop_channel),
            ok
    end.

%% delivered (processed, or in a consumer's mailbox) + lost = sent ok.
final_check() ->
    Held = case {get(prop_channel), get(prop_alive)} of
               {{_, Consumer}, true} -> queue_len(Consumer);
               _ -> 0
           end,
    Delivered = count(prop_processed) + count(prop_held) + Held,
    Lost = count(prop_lost),
    case Delivered + Lost =:= count(prop_sent_ok) of
        true -> ok;
        false -> {unaccounted, #{delivered => Delivered, lost => Lost,
                                 sent_ok => count(prop_sent_ok)}}
    end.

count(Key) ->
    case get(Key) of undefined -> 0; V -> V end.

cleanup() ->
    _ = (catch stop_current()),
    [erase(K) || K <- [prop_channel, prop_alive, prop_seq, prop_sent_ok, prop_lost,
                       prop_processed, prop_held]],
    flush().

flush() ->
    receive _ -> flush() after 0 -> ok end.
